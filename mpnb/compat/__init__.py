"""Run and port Apex code: the ``apex`` import alias, the name table, the CPU rehearsal, the report.

* :func:`apex_alias` makes ``import apex`` (and Apex's extension modules such as ``amp_C``)
  resolve to mpnb, by the table in :mod:`mpnb.compat.names`.
* :class:`CpuRehearsal` runs a CUDA-only Apex script on a CPU (``python -m mpnb.apex --cpu``).
* :func:`check_script` lists the Apex names a script uses and what mpnb does with each
  (``python -m mpnb.apex --check``).

The other modules of this package (``amp_state``, ``apex_C``, ``fused_adam_cuda``,
``fused_layer_norm``, ``fused_layer_norm_cuda``, ``generic_scaled_masked_softmax_cuda``,
``syncbn``) are compatibility surfaces that the alias serves under Apex's names, and
``apex_rules`` holds mpnb's objects configured with Apex's rounding where mpnb's default
differs (what the alias serves for those names).
"""

from mpnb.compat.alias import ApexAlias, ApexModuleProxy, apex_alias
from mpnb.compat.check import NameReport, check_script, format_report
from mpnb.compat.names import MODULES, NAMES, ApexModule, ApexName
from mpnb.compat.rehearsal import CpuRehearsal

__all__ = [
    "apex_alias",
    "ApexAlias",
    "ApexModuleProxy",
    "MODULES",
    "NAMES",
    "ApexModule",
    "ApexName",
    "CpuRehearsal",
    "check_script",
    "format_report",
    "NameReport",
]
