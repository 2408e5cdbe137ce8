"""The guards the Triton launchers keep for themselves: the raw-address rule of a launch, and
the per-tensor checks of a list op in one pass.

Every argument check of an op lives once, in its ``check`` (:mod:`mpnb.core.ops._library`).
What no op check can know is the raw-address rule of a launch: a one-element flag or scale read
by the kernel must live on the data's device (a CPU tensor's address read on a GPU is out of
bounds, where the references and PyTorch's ops would copy it over): :func:`check_same_device`.

A list launcher reads every tensor of its lists through the chunk table, so each tensor must
have its partner's size, its list's dtype, a contiguous layout and the lists' device, and the
table is keyed by every tensor's size and address. Read in Python, that is one attribute per
tensor per fact (a few hundred nanoseconds each, thousands of tensors per optimizer step);
:func:`guard_lists` reads each tensor once, in C++ (``csrc/cpu/list_facts.cpp``: a Python
builtin function the library makes, not an op, so the lists do not cross the dispatcher a
second time), and returns the ids the table is keyed by; it also holds the raw-address rule
for the op's single tensors. It holds the same conditions as the op's per-tensor checks; when
one fails it raises a short ``RuntimeError``
and the op's whole check runs, whose named error replaces it (:mod:`mpnb.core.ops._library`,
as for a C++ kernel's refusal). A launcher that calls it says so (``guards_lists = True``): its
op then runs the per-tensor checks only on a refusal. Without the C++ library (no compiler,
``MPNB_DISABLE_EXT=1``), under a dispatch mode or with tensor subclasses, the same facts are read
in Python.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence
from itertools import compress

import torch

from mpnb.core.ops._build import cpu_extension

__all__ = [
    "BELOW_2E32",
    "CONTIGUOUS",
    "DATA",
    "ONE_DEVICE",
    "ONE_DTYPE",
    "PAIRED",
    "SINGLES",
    "ListIds",
    "check_same_device",
    "guard_lists",
    "list_facts",
]

# Flag bits per list of the C++ pass (the same constants in csrc/cpu/list_facts.cpp).
ONE_DTYPE = 1  #: every tensor has the list's first dtype
CONTIGUOUS = 2  #: every tensor is contiguous
PAIRED = 4  #: as many tensors as the first list, each with its partner's number of elements
SINGLES = 8  #: every tensor holds one element
ONE_DEVICE = 16  #: every tensor on the device of the call's first tensor
BELOW_2E32 = 32  #: every tensor holds fewer than 2^32 elements
#: what a list read element by element needs (its dtype, its layout, its partner's size)
DATA = ONE_DTYPE | CONTIGUOUS | PAIRED

_NATIVE: list = [None]  # the C pass once the C++ library is loaded (False: it lacks it)
_WHAT = (
    (ONE_DEVICE, "its tensors are on several devices"),
    (ONE_DTYPE, "its tensors have several dtypes"),
    (CONTIGUOUS, "a tensor is not contiguous"),
    (PAIRED, "a tensor's size differs from its partner's"),
    (SINGLES, "a tensor holds more than one element"),
    (BELOW_2E32, "a tensor holds 2^32 elements or more"),
)
_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")
_FIELDS: dict[type, tuple] = {}  # _fields, per op


def check_same_device(op: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise unless every given tensor lives on ``ref``'s device."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but the data is on {ref.device}; move it to "
                f"{ref.device}."
            )


def _native():
    """The C pass of the loaded library as a Python builtin function (made once by
    ``mpnb_list_facts_function``, found through ctypes; called directly after that), or None:
    no library, or one built without Python's headers."""
    fn = _NATIVE[0]
    if fn is None:
        status = cpu_extension().status()
        if status is None or not status.loaded:
            return None
        try:
            make = ctypes.PyDLL(status.path).mpnb_list_facts_function
        except (OSError, AttributeError):  # built without Python.h: read in Python
            fn = False
        else:
            make.restype, make.argtypes = ctypes.py_object, ()
            fn = make()
        _NATIVE[0] = fn
    return fn or None


def list_facts(lists: Sequence[Sequence[torch.Tensor]]) -> tuple[list[int], dict] | None:
    """``(flags, ids)`` of ``lists`` (at most eight), read in one C++ pass: ``flags`` one int
    per list, ``ids`` the dict from each list object's ``id()`` to the id of its contents; None
    where that pass cannot run (no C++ library, more lists, anything but plain tensors, a
    dispatch or function mode).

    The flags are the bits above; ``PAIRED`` and ``ONE_DEVICE`` compare with ``lists[0]`` and
    with the first tensor of the first non-empty list. Equal ids mean equal lists: the same
    length and device and, tensor by tensor, the same number of elements at the same address.
    """
    fn = _NATIVE[0] or _native()
    if fn is None:
        return None
    try:
        return fn(lists)
    except TypeError:  # a list that is no sequence
        return None


def _python_flags(lists: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """The flags of :func:`list_facts`, read in Python (its ids are not needed here)."""
    ref = list(map(torch.Tensor.numel, lists[0])) if lists else []
    device = next((lst[0].device for lst in lists if lst), None)
    out = []
    for lst in lists:
        numels = list(map(torch.Tensor.numel, lst))
        flags = PAIRED if numels == ref else 0
        flags |= ONE_DTYPE if len(set(map(_DTYPE, lst))) <= 1 else 0
        flags |= CONTIGUOUS if all(map(torch.Tensor.is_contiguous, lst)) else 0
        flags |= SINGLES if numels.count(1) == len(numels) else 0
        flags |= ONE_DEVICE if set(map(_DEVICE, lst)) <= {device} else 0
        flags |= BELOW_2E32 if max(numels, default=0) < 1 << 32 else 0
        out.append(flags)
    return out


#: the ids of one call's tensor lists (:func:`list_facts`): ``id()`` of each list object -> the
#: id of its contents (what :meth:`~._chunks.ChunkTable.build` keys its table by)
ListIds = dict


def guard_lists(
    args,
    data: Sequence[str],
    singles: Sequence[str] = (),
    below_2e32: Sequence[str] = (),
    dtypes: Sequence[tuple[str, torch.dtype]] = (),
) -> ListIds | None:
    """The per-tensor checks of a list op, in one pass over its tensor lists; returns their
    ids for the chunk table (None when the pass ran in Python: the table then keys by sizes and
    addresses itself).

    Every tensor of every list argument of ``args`` lives on one device, and so does every
    single tensor argument (a flag, a scale, a learning rate: the kernel reads it by address;
    a ``ValueError`` of :func:`check_same_device` names it). Each non-empty list named in
    ``data`` holds, like the first list argument, one tensor per partner with its partner's
    size, one dtype and contiguous tensors; each in ``singles`` one-element tensors of one
    dtype; each in ``below_2e32`` tensors below 2^32 elements; ``dtypes`` gives ``(name,
    dtype)`` pairs, the dtype a non-empty list must have. Raises ``RuntimeError`` naming the
    first failing list (the op's check then names the tensor, :mod:`mpnb.core.ops._library`).

    What each list needs is worked out once per op, set of non-empty lists and set of
    conditions (:func:`_plan`): a call pays for the C++ pass and one test per list.

    Example::

        >>> ids = guard_lists(args, data=("src", "dst"))
        >>> ChunkTable.build([args.src, args.dst], ids=ids)
    """
    list_fields, single_fields, get_lists = _FIELDS.get(type(args)) or _fields(args)
    every = get_lists(args)  # each list field's value, in one C call
    present = tuple(compress(list_fields, every))
    if not present:
        return None
    lists = list(filter(None, every))
    key = (type(args), present, tuple(data), tuple(singles), tuple(below_2e32), tuple(dtypes))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(type(args), *key[1:])
    fn = _NATIVE[0]  # list_facts(lists), its call saved where the pass is loaded
    facts = fn(lists) if fn else list_facts(lists)
    flags = facts[0] if facts is not None else _python_flags(lists)
    for j, name, need, want in plan:
        if flags[j] & need != need:
            what = next(w for bit, w in _WHAT if need & bit and not flags[j] & bit)
            _refuse(args, name, what)
        if want is not None and lists[j][0].dtype != want:
            _refuse(args, name, f"its tensors are {lists[j][0].dtype}, not {want}")
    ref = lists[0][0]  # the single tensors are read by address: on the data's device
    device = ref.device
    for i in single_fields:
        t = args[i]
        if t is not None and t.device != device:
            check_same_device(args.op_name, ref, **{type(args)._fields[i]: t})
    return None if facts is None else facts[1]


#: (op's argument type, its non-empty lists, the conditions) -> what each of those lists needs
_PLANS: dict[tuple, tuple[tuple[int, str, int, torch.dtype | None], ...]] = {}


def _plan(
    Args: type,
    present: tuple[int, ...],
    data: tuple[str, ...],
    singles: tuple[str, ...],
    below_2e32: tuple[str, ...],
    dtypes: tuple[tuple[str, torch.dtype], ...],
) -> tuple[tuple[int, str, int, torch.dtype | None], ...]:
    """Per non-empty list (``present``: its field positions in ``Args``): its position among
    them, its name, the flag bits it needs and the dtype it must have (or None)."""
    want = dict(dtypes)
    out = []
    for j, i in enumerate(present):
        name = Args._fields[i]
        need = ONE_DEVICE
        need |= DATA if name in data else 0
        need |= SINGLES | ONE_DTYPE if name in singles else 0
        need |= BELOW_2E32 if name in below_2e32 else 0
        out.append((j, name, need, want.get(name)))
    return tuple(out)


def _fields(args) -> tuple[tuple[int, ...], tuple[int, ...], Callable]:
    """The positions of ``args``' tensor lists and single tensors, read off its op's schema
    once per op, and a getter of the lists' values as a tuple."""
    found = _FIELDS.get(type(args))
    if found is None:
        schema = getattr(torch.ops.mpnb, args.op_name).default._schema
        kinds = [str(a.type) for a in schema.arguments]
        lists = tuple(i for i, k in enumerate(kinds) if k == "List[Tensor]")
        singles = tuple(i for i, k in enumerate(kinds) if k in ("Tensor", "Optional[Tensor]"))
        get = (
            operator.itemgetter(*lists) if len(lists) > 1 else lambda a: tuple(a[i] for i in lists)
        )
        found = _FIELDS[type(args)] = (lists, singles, get)
    return found


def _refuse(args, name: str, what: str) -> None:
    raise RuntimeError(
        f"{args.op_name}: the Triton launch refused list '{name}': {what}; the op's check "
        "names the tensor (call the op through its wrapper, mpnb.core.ops)."
    )
