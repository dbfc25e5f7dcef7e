"""CUDA C source strings and the lazily compiled modules built from them.

Each kernel family lives in its own module as a ``*_KERNEL`` source string and a
``*_MODULE`` :class:`KernelModule`; nothing is compiled at import, only on first launch.
"""

from xferlib._kernels._declare import KernelDecl, defines, named
from xferlib._kernels._registry import KernelModule, all_modules, grid_1d, launch_config
from xferlib._kernels.cache import CACHE_KERNEL, CACHE_MODULE
from xferlib._kernels.collection import COLLECTION_KERNEL, COLLECTION_MODULE
from xferlib._kernels.collection_update import UPDATE_KERNEL, all_update_modules
from xferlib._kernels.exchange import EXCHANGE_KERNEL, EXCHANGE_MODULE
from xferlib._kernels.interaction import INTERACTION_KERNEL, INTERACTION_MODULE
from xferlib._kernels.optim import OPTIM_KERNEL, OPTIM_MODULE
from xferlib._kernels.radix import RADIX_KERNEL, RADIX_MODULE
from xferlib._kernels.rows import ROWS_KERNEL, ROWS_MODULE
from xferlib._kernels.scattered import SCATTERED_KERNEL, SCATTERED_MODULE
from xferlib._kernels.table import TABLE_KERNEL, TABLE_MODULE
from xferlib._kernels.tt import TT_KERNEL, TT_MODULE  # FBTT's shape: one module per TT shape
from xferlib._kernels.verdict import VERDICT_KERNEL, VERDICT_MODULE

__all__ = ["KernelDecl", "defines", "named", "KernelModule", "all_modules", "grid_1d",
           "launch_config", "CACHE_KERNEL", "CACHE_MODULE", "COLLECTION_KERNEL",
           "COLLECTION_MODULE", "UPDATE_KERNEL", "all_update_modules", "EXCHANGE_KERNEL",
           "EXCHANGE_MODULE", "INTERACTION_KERNEL", "INTERACTION_MODULE", "OPTIM_KERNEL",
           "OPTIM_MODULE", "RADIX_KERNEL", "RADIX_MODULE", "ROWS_KERNEL", "ROWS_MODULE",
           "SCATTERED_KERNEL", "SCATTERED_MODULE",
           "TABLE_KERNEL", "TABLE_MODULE", "TT_KERNEL", "TT_MODULE", "VERDICT_KERNEL",
           "VERDICT_MODULE"]
