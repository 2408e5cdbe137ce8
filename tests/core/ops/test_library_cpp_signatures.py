"""The C++ kernels' parameters against the schemas: names, order and types.

At ``m.impl`` PyTorch checks a C++ kernel's argument count and types, never its names, so two
adjacent doubles (``lr, beta1, beta2, eps, weight_decay``) can be swapped and still register.
This test reads every ``m.impl("<op>", &<fn>)`` of the ``TORCH_LIBRARY_IMPL(mpnb, CPU, m)``
blocks in ``csrc/cpu/*.cpp``, parses ``<fn>``'s parameter list and compares it, position by
position, with ``OpInfo.schema``. It then follows the kernel's calls into the helpers defined
in ``csrc/cpu`` (``torch_fused_step(..., lr, beta1, beta2, ...)``, ``norm_fwd(input, ...)``): an
argument spelled as one of the op's schema names, passed where the helper's parameter carries
another of the op's schema names, is a swap too.

Names are compared after one normalisation: a trailing ``_`` is dropped. ``params_`` is the
house's spelling of the raw argument whose checked view the body declares as ``params``
(``const TensorRefs params(params_)``). A parameter the body does not read is named in a
comment (``bool /*memory_efficient*/``); the test reads that name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

import mpnb.core.ops as ops
from mpnb.core.ops._build import csrc_dir

# -- a small reader of the C++ the kernels are written in ------------------------------------

_IMPL_BLOCK = re.compile(r"TORCH_LIBRARY_IMPL\(\s*mpnb\s*,\s*CPU\s*,\s*m\s*\)\s*\{")
_IMPL = re.compile(r'm\.impl\(\s*"(\w+)"\s*,\s*&?\s*([\w:]+)\s*\)')
_NAMED_IN_COMMENT = re.compile(r"/\*\s*(\w+)\s*\*/")
_KEYWORDS = frozenset(
    "if for while switch return sizeof alignof catch operator decltype static_assert "
    "noexcept throw new delete defined".split()
)
_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*(<)?")

# schema type (str(torch argument type)) -> the C++ parameter types that receive it, spelled
# without const, references and whitespace
_CPP_TYPES = {
    "Tensor": {"at::Tensor", "Tensor"},
    "Optional[Tensor]": {"std::optional<at::Tensor>", "c10::optional<at::Tensor>"},
    "List[Tensor]": {
        "Tensors",
        "c10::List<at::Tensor>",
        "at::TensorList",
        "c10::ArrayRef<at::Tensor>",
    },
    "float": {"double"},
    "int": {"int64_t"},
    "bool": {"bool"},
    "str": {"c10::string_view", "std::string_view", "std::string"},
    "List[int]": {"at::IntArrayRef", "c10::IntArrayRef", "std::vector<int64_t>"},
    "List[bool]": {"c10::List<bool>"},
}


@dataclass(frozen=True)
class Param:
    """One C++ parameter: its type (without const and references) and its name."""

    type: str
    name: str


@dataclass(frozen=True)
class Function:
    """One C++ function definition: its name, parameters, body and where it is."""

    name: str
    params: tuple[Param, ...]
    body: str
    where: str


def _strip_comments(src: str) -> str:
    """The source without comments (a ``/*name*/`` parameter name is kept as ``name``) and
    with string literals emptied (the op names of ``m.impl`` excepted), so that neither can
    look like code."""
    src = re.sub(r'(?<!m\.impl\()"(?:\\.|[^"\\\n])*"', '""', src)
    src = _NAMED_IN_COMMENT.sub(r" \1 ", src)
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _closing(src: str, i: int, open_: str, close: str) -> int:
    """The index just past the bracket that closes the one opened at ``src[i]``."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == open_:
            depth += 1
        elif src[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {open_!r} at offset {i}")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside any bracket (template arguments included)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_params(text: str) -> tuple[Param, ...]:
    """The parameters of a C++ parameter list (the text between the parentheses)."""
    out = []
    for part in _split_top(text):
        if part in ("", "void"):
            continue
        depth, cut = 0, len(part)
        for j, ch in enumerate(part):  # a default value starts at the first top-level '='
            depth += ch in "(<[{"
            depth -= ch in ")>]}"
            if ch == "=" and depth == 0:
                cut = j
                break
        decl = part[:cut].strip()
        m = re.fullmatch(r"(.*?[\s&*>])\s*([A-Za-z_]\w*)", decl, flags=re.S)
        if m is None:
            raise ValueError(f"cannot read the parameter {part!r}: name it (or /*name*/ it)")
        ty = re.sub(r"\bconst\b|&|\s", "", m.group(1))
        out.append(Param(ty, m.group(2)))
    return tuple(out)


def parse_functions(src: str, where: str) -> list[Function]:
    """Every function definition in ``src`` (comments already stripped): a name, a
    parameter list and a body in braces, with at most qualifiers between them."""
    found = []
    for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", src):
        name = m.group(1)
        if name in _KEYWORDS:
            continue
        start = m.end() - 1
        try:
            end = _closing(src, start, "(", ")")
        except ValueError:
            continue
        after = re.match(r"\s*((?:const|noexcept|override|final|mutable)\s*)*\{", src[end:])
        if after is None:
            continue
        before = src[: m.start()].rstrip()
        if not before or before[-1] in "=(,!?:+-/|;{}" and not before.endswith("::"):
            continue  # a call or a constructor call, not a definition
        brace = end + after.end() - 1
        try:
            params = parse_params(src[start + 1 : end - 1])
        except ValueError:
            continue  # not a parameter list (a call followed by a block)
        body = src[brace + 1 : _closing(src, brace, "{", "}") - 1]
        found.append(Function(name, params, body, where))
    return found


def registrations(src: str) -> list[tuple[str, str]]:
    """``(op, C++ function)`` of every ``m.impl`` in the CPU blocks of ``src``."""
    out = []
    for block in _IMPL_BLOCK.finditer(src):
        text = src[block.end() - 1 : _closing(src, block.end() - 1, "{", "}")]
        out += [(op, fn.split("::")[-1]) for op, fn in _IMPL.findall(text)]
    return out


def calls(body: str) -> list[tuple[str, list[str]]]:
    """``(callee, arguments)`` of every call in ``body`` (template arguments skipped)."""
    out = []
    for m in _CALL.finditer(body):
        name, i = m.group(1), m.end()
        if name in _KEYWORDS:
            continue
        if m.group(2):  # name<...>(
            try:
                i = _closing(body, i - 1, "<", ">")
            except ValueError:
                continue
        j = len(body[i:]) - len(body[i:].lstrip())
        if body[i + j : i + j + 1] != "(":
            continue
        start = i + j
        try:
            end = _closing(body, start, "(", ")")
        except ValueError:
            continue
        out.append((name, _split_top(body[start + 1 : end - 1])))
    return out


# -- the comparison ----------------------------------------------------------------------------


def _norm(name: str) -> str:
    return name[:-1] if name.endswith("_") and len(name) > 1 else name


@dataclass(frozen=True)
class Mismatch:
    """One disagreement with a schema: where (op, C++ function, the helper called, or None
    for the kernel's own parameters), the position, and what the schema and the C++ say."""

    op: str
    function: str
    position: int | None
    schema: str
    cpp: str
    callee: str | None = None
    note: str = ""

    def __str__(self) -> str:
        at = f"mpnb::{self.op} ({self.function}"
        if self.callee is not None:
            return (
                f"{at} calls {self.callee}): argument {self.position} passes {self.cpp!r} "
                f"where {self.callee}'s parameter is {self.schema!r}, another argument of the "
                "op; pass the argument of that name"
            )
        if self.position is None:
            return f"{at}): {self.note}"
        return (
            f"{at}): argument {self.position} is {self.schema!r} in the schema but "
            f"{self.cpp!r} in C++; {self.note or 'rename the C++ parameter (or fix the order)'}"
        )


def check_signature(op: str, fn: Function, schema: list[tuple[str, str]]) -> list[Mismatch]:
    """The mismatches of ``fn``'s parameters against ``schema`` (``(name, type)`` in order):
    one per position whose name (or type) differs, or one for a different count."""
    where = f"{fn.where}, {fn.name}"
    if len(fn.params) != len(schema):
        cpp, names = [p.name for p in fn.params], [n for n, _ in schema]
        note = f"{len(cpp)} C++ parameters {cpp} for {len(names)} schema arguments {names}"
        return [Mismatch(op, where, None, str(names), str(cpp), note=note)]
    problems = []
    for i, (p, (name, ty)) in enumerate(zip(fn.params, schema, strict=True)):
        if _norm(p.name) != name:
            problems.append(Mismatch(op, where, i, name, p.name))
        elif p.type not in _CPP_TYPES.get(ty, set()):
            note = f"{ty} is received as one of {sorted(_CPP_TYPES.get(ty, ()))}, not {p.type}"
            problems.append(Mismatch(op, where, i, name, p.name, note=note))
    return problems


def check_forwarding(
    op: str, fn: Function, types: dict[str, str], index: dict[str, list[Function]]
) -> list[Mismatch]:
    """The swaps in the calls ``fn`` makes to helpers of ``csrc/cpu`` (followed down, each
    helper once): an argument named as one of the op's schema arguments lands on a helper
    parameter named as another one of the same schema type (``types``: name -> type; a pair
    of different types would not compile swapped, and a generic helper's ``a, b`` beside
    an op's float ``a, b`` is no swap)."""
    problems, seen, todo = [], {fn.name}, [fn]
    while todo:
        caller = todo.pop()
        for callee, args in calls(caller.body):
            for target in index.get(callee, []):
                if len(target.params) != len(args) or target is caller:
                    continue
                for i, (arg, p) in enumerate(zip(args, target.params, strict=True)):
                    a, q = _norm(arg), _norm(p.name)
                    if a != q and a in types and types[a] == types.get(q):
                        where = f"{caller.where}, {caller.name}"
                        problems.append(Mismatch(op, where, i, p.name, arg, callee=callee))
                if target.name not in seen:
                    seen.add(target.name)
                    todo.append(target)
    return problems


def _sources() -> dict[str, str]:
    root = csrc_dir() / "cpu"
    files = sorted(root.glob("*.cpp")) + sorted(root.glob("*.h"))
    return {f"csrc/cpu/{p.name}": _strip_comments(p.read_text()) for p in files}


def _index(sources: dict[str, str]) -> dict[str, list[Function]]:
    index: dict[str, list[Function]] = {}
    for where, src in sources.items():
        for f in parse_functions(src, where):
            index.setdefault(f.name, []).append(f)
    return index


def _schema(op: str) -> list[tuple[str, str]]:
    args = ops.op_info(op).overload._schema.arguments
    return [(a.name, str(a.type)) for a in args]


def audit(sources: dict[str, str]) -> tuple[list[Mismatch], list[str]]:
    """``(mismatches, checked ops)`` of every CPU registration in ``sources``."""
    index = _index(sources)
    problems, checked = [], []
    for where, src in sources.items():
        for op, fn_name in registrations(src):
            defs = index.get(fn_name, [])
            defs = [f for f in defs if f.where == where] or defs  # its own file first
            if len(defs) != 1:
                note = (
                    f"m.impl names a function that csrc/cpu defines {len(defs)} times; define "
                    "the kernel once (one overload), beside its registration"
                )
                problems.append(Mismatch(op, f"{where}, {fn_name}", None, "", "", note=note))
                continue
            schema = _schema(op)
            problems += check_signature(op, defs[0], schema)
            problems += check_forwarding(op, defs[0], dict(schema), index)
            checked.append(op)
    return problems, checked


# -- the tests ---------------------------------------------------------------------------------


def test_every_cpu_kernel_matches_its_schema():
    problems, checked = audit(_sources())
    assert not problems, "\n".join(map(str, problems))
    with_kernel = {op.name for op in ops.all_ops() if op.cpu_kernel}
    assert set(checked) == with_kernel, (
        f"ops with cpu_kernel=True but no m.impl found: {sorted(with_kernel - set(checked))}; "
        f"m.impl of ops the table does not mark: {sorted(set(checked) - with_kernel)}"
    )
    assert len(checked) == len(set(checked)), "an op is registered twice for the CPU"


def _patched(path: str, old: str, new: str) -> dict[str, str]:
    sources = _sources()
    assert sources[path].count(old) == 1, f"{old!r} is not once in {path}: update this test"
    sources[path] = sources[path].replace(old, new)
    return sources


def test_a_swapped_pair_of_doubles_in_a_signature_is_reported():
    """``beta1`` and ``beta2`` swapped in ``fused_adam_cpu``'s parameters (same types, so
    ``m.impl`` would accept it): reported with the op, the position and both names."""
    sources = _patched(
        "csrc/cpu/adam.cpp",
        "double lr_,\n                           double beta1, double beta2,",
        "double lr_,\n                           double beta2, double beta1,",
    )
    problems, _ = audit(sources)
    where = "csrc/cpu/adam.cpp, fused_adam_cpu"
    assert problems == [
        Mismatch("fused_adam_", where, 7, schema="beta1", cpp="beta2"),
        Mismatch("fused_adam_", where, 8, schema="beta2", cpp="beta1"),
    ]
    assert "argument 7 is 'beta1' in the schema but 'beta2'" in str(problems[0])


def test_a_swapped_pair_passed_on_to_a_helper_is_reported():
    """``eps`` and ``weight_decay`` swapped where ``fused_adam_cpu`` hands them to
    ``torch_fused_step``: reported with the caller, the helper and both names."""
    sources = _patched(
        "csrc/cpu/adam.cpp",
        "beta1, beta2, eps,\n                     weight_decay, adam_w_mode);",
        "beta1, beta2, weight_decay,\n                     eps, adam_w_mode);",
    )
    problems, _ = audit(sources)
    where = "csrc/cpu/adam.cpp, fused_adam_cpu"
    assert problems == [
        Mismatch("fused_adam_", where, 9, "eps", "weight_decay", callee="torch_fused_step"),
        Mismatch("fused_adam_", where, 10, "weight_decay", "eps", callee="torch_fused_step"),
    ]
    assert "argument 9 passes 'weight_decay' where torch_fused_step's" in str(problems[0])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("const at::Tensor& x, double s = 1.0", [("at::Tensor", "x"), ("double", "s")]),
        (
            "const std::optional<at::Tensor>& w,\n bool /*unused*/, c10::string_view layout",
            [
                ("std::optional<at::Tensor>", "w"),
                ("bool", "unused"),
                ("c10::string_view", "layout"),
            ],
        ),
        (
            "at::IntArrayRef shape, const c10::List<bool>& flags",
            [("at::IntArrayRef", "shape"), ("c10::List<bool>", "flags")],
        ),
        ("std::map<int, int> m = {}", [("std::map<int,int>", "m")]),
    ],
)
def test_the_parameter_reader(text, expected):
    got = parse_params(_strip_comments(text))
    assert [(p.type, p.name) for p in got] == expected


def test_an_unnamed_parameter_is_refused():
    with pytest.raises(ValueError, match="name it"):
        parse_params("const at::Tensor& x, bool")
