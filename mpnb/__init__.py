"""mpnb: NVIDIA Apex re-implemented on modern PyTorch, and a lab that measures mixed precision.

The Apex module names (``mpnb.amp``, ``mpnb.optimizers``, ``mpnb.multi_tensor_apply``,
``mpnb.amp_C``...) are importable submodules, each re-exporting its ``mpnb.core`` module;
:mod:`mpnb.compat.names` lists every Apex name and where it lives in mpnb, and
``python -m mpnb.apex SCRIPT`` runs an unchanged Apex script. Importing ``mpnb`` itself is
cheap and never compiles anything (the C++ kernels are built on first use, or by
``mpnb build-ext``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
