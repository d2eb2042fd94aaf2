"""LGC: learned gradient compression (Abrahamyan et al. 2021), the parameter-server and the all-reduce variants."""

from lightning_gradcomp.compressors.lgc.allreduce import LGCAllReduce
from lightning_gradcomp.compressors.lgc.ps import LGC

__all__ = ["LGC", "LGCAllReduce"]
