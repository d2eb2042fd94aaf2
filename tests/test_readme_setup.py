"""The README's CPU-only install checks the torch/torchvision pair and says what to do when it does not import."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_INDEX = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_cpu_only_install_is_followed_by_a_check_of_the_pair_that_runs():
    blocks = re.findall(r"```bash\n(.*?)```", _readme(), flags=re.S)
    block = next(b for b in blocks if CPU_INDEX in b)
    lines = block.splitlines()
    check = lines[lines.index(next(line for line in lines if CPU_INDEX in line)) + 1]
    assert check.startswith('python -c "import torch, torchvision')
    command = shlex.split(check.split("#")[0])
    result = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.split()) == 2, "both versions printed"


def test_the_failure_of_the_check_is_explained_with_its_fix():
    readme = _readme()
    after = readme[readme.index(CPU_INDEX) :]
    assert "operator torchvision::nms does not exist" in after
    assert "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cpu" in after
