"""Small offline workloads shared by the benchmarks in ``benchmarks/`` and by the tests.

scikit-learn's bundled digits with an MLP (:mod:`~lightning_gradcomp.demo.digits`, also a convnet on a fixed
split), and the models and data of the compression-ratio and convergence measurements
(:mod:`~lightning_gradcomp.demo.workloads`: a digits CNN and a character LSTM over the Python standard library's
source). In the package, not in
``benchmarks/``, so that benchmarks run as scripts and the tests and spawned worker processes import them without
editing ``sys.path``. Nothing in the rest of the package imports this.
"""
