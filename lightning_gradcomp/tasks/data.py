"""DataModules: scikit-learn's bundled digits (offline) and CIFAR-10 (downloaded through torchvision)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gradcomp.validation import check_bool, check_int, check_number, check_positive_int


def flip_labels(
    labels: torch.Tensor, fraction: float, generator: torch.Generator, num_classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace ``fraction`` of ``labels`` by a different class drawn uniformly (label noise for TracIn's demo).

    Returns the new labels and the sorted indices of the changed ones.
    """
    count = int(round(fraction * len(labels)))
    flipped = torch.randperm(len(labels), generator=generator)[:count].sort().values
    shift = torch.randint(1, num_classes, (count,), generator=generator)  # never the original class
    noisy = labels.clone()
    noisy[flipped] = (noisy[flipped] + shift) % num_classes
    return noisy, flipped


def _set_up(dataset: Dataset | None, name: str) -> Dataset:
    """``dataset``, which ``setup`` makes: a clear error when a loader is asked for before it ran."""
    if dataset is None:
        raise RuntimeError(f"`{name}` is made in `setup()`: call it before asking for a data loader.")
    return dataset


class DigitsDataModule(pl.LightningDataModule):
    """The 1,797 8x8 handwritten digits that ship with scikit-learn: a small, real, offline image dataset.

    Images are scaled to [0, 1] and standardised; the split into training and validation sets is fixed by ``seed``.

    Args:
        batch_size: samples per batch and process.
        val_fraction: fraction of the images held out for validation (and test).
        label_noise: fraction of the *training* labels replaced by a different random class (TracIn's
            mislabeled-data demo); the flipped indices are in :attr:`flipped`.
        seed: seed of the split and of the label noise.

    Raises:
        MisconfigurationException: If an argument is out of range, or scikit-learn is not installed.
    """

    def __init__(
        self, batch_size: int = 32, val_fraction: float = 0.2, label_noise: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        check_positive_int(batch_size, "batch_size", error=MisconfigurationException)
        check_number(
            val_fraction, "val_fraction", low=0, high=1, low_open=True, high_open=True, error=MisconfigurationException
        )
        check_number(label_noise, "label_noise", low=0, high=1, high_open=True, error=MisconfigurationException)
        check_int(seed, "seed", error=MisconfigurationException)
        self.batch_size, self.val_fraction, self.label_noise, self.seed = batch_size, val_fraction, label_noise, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.flipped = torch.empty(0, dtype=torch.long)

    def setup(self, stage: str | None = None) -> None:
        """Load, standardise, split and (optionally) corrupt the labels; identical on every rank."""
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise MisconfigurationException(
                "DigitsDataModule needs scikit-learn (its bundled digits dataset):"
                " pip install 'lightning-gradcomp[datasets]'"
            ) from error
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        g = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(y), generator=g)
        n_val = int(round(self.val_fraction * len(y)))
        train, val = order[n_val:], order[:n_val]
        mean, std = x[train].mean(), x[train].std()
        x = (x - mean) / std
        y_train = y[train]
        if self.label_noise > 0:
            y_train, self.flipped = flip_labels(y_train, self.label_noise, g)
        self.train_set = TensorDataset(x[train], y_train)
        self.val_set = TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        """Shuffled each epoch (Lightning's DistributedSampler shards it across ranks)."""
        return DataLoader(_set_up(self.train_set, "train_set"), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """The held-out images."""
        return DataLoader(_set_up(self.val_set, "val_set"), batch_size=256)

    def test_dataloader(self) -> DataLoader:
        """The held-out images (digits has no separate test set)."""
        return self.val_dataloader()


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 through torchvision, with the standard augmentation (random crop with padding 4, horizontal flip).

    The dataset is downloaded into ``data_dir`` when it is not there yet; that needs internet access. Offline,
    place the extracted ``cifar-10-batches-py`` folder in ``data_dir`` (or use ``DigitsDataModule`` to try things).

    Args:
        data_dir: where the dataset is, or is downloaded to.
        batch_size: samples per batch and process (the papers use 128 per worker).
        num_workers: data-loading processes per training process.
        download: download the dataset if it is missing.
        augment: random crop and flip for training.

    Raises:
        MisconfigurationException: If an argument is out of range; in ``prepare_data``, if the dataset is missing
            and cannot be downloaded.
    """

    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 128,
        num_workers: int = 4,
        download: bool = True,
        augment: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int(batch_size, "batch_size", error=MisconfigurationException)
        check_int(num_workers, "num_workers", low=0, error=MisconfigurationException)
        check_bool(download, "download", error=MisconfigurationException)
        check_bool(augment, "augment", error=MisconfigurationException)
        self.data_dir, self.batch_size, self.num_workers = data_dir, batch_size, num_workers
        self.download, self.augment = download, augment

    def _dataset(self, train: bool, transform: object) -> Dataset:
        from torchvision.datasets import CIFAR10

        return CIFAR10(self.data_dir, train=train, transform=transform, download=False)

    def prepare_data(self) -> None:
        """Download once (rank 0 of each node), or explain what is missing when that fails."""
        from torchvision.datasets import CIFAR10

        present = os.path.isdir(os.path.join(self.data_dir, "cifar-10-batches-py"))
        if present:
            return
        if not self.download:
            raise MisconfigurationException(
                f"CIFAR-10 is not in `data_dir`={self.data_dir!r} and `download` is false: put the extracted"
                " cifar-10-batches-py folder there or set download: true."
            )
        try:
            CIFAR10(self.data_dir, train=True, download=True)
            CIFAR10(self.data_dir, train=False, download=True)
        except Exception as error:
            raise MisconfigurationException(
                f"CIFAR-10 is not in `data_dir`={self.data_dir!r} and could not be downloaded ({error}). This recipe"
                " needs internet access once, or the extracted cifar-10-batches-py folder in data_dir. To try"
                " lightning-gradcomp offline, run `lightning-gradcomp quickstart` (scikit-learn's digits)."
            ) from error

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets with their transforms."""
        from torchvision import transforms

        normalize = transforms.Normalize(self.mean, self.std)
        train_tf = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if self.augment else []
        self.train_set = self._dataset(True, transforms.Compose([*train_tf, transforms.ToTensor(), normalize]))
        self.test_set = self._dataset(False, transforms.Compose([transforms.ToTensor(), normalize]))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training images."""
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            drop_last=True,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """The 10,000 test images (the papers report test accuracy)."""
        return DataLoader(self.test_set, batch_size=512, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The 10,000 test images."""
        return self.val_dataloader()
