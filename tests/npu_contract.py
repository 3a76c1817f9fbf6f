"""The NPU contract: this project's torch_npu calls and the tests' NPU fakes, checked against the real release.

CI has no Ascend NPU, so the NPU backend and the ``npu_fusion`` strategy only ever run against fakes we
wrote. A fake that accepts an argument the real function does not (or a real default that differs from
what we assume, such as ``npu_fusion_attention``'s ``scale=1.0``) would let every test pass and crash the
first Ascend user. The real release is the truth, and its Python sources can be read without importing it
(``import torch_npu`` needs CANN; installing it breaks ``import torch`` here). This module:

* fetches the ``torch_npu`` wheel pinned in ``requirements_npu.txt`` (``pip download --no-deps``, once, into
  a cache folder) and reads it as a zip: it is never installed or imported;
* derives, with ``ast``, every torch_npu / ``torch.npu`` / torchair name that ``hidream_ui/**/*.py`` calls or
  references (`scan_source`; no hand-kept list), resolves each in the release (`Release.resolve`: Python
  definitions, following the package's imports; custom ops exported from ``torch.ops.npu`` by their schema in
  ``csrc/aten/*.yaml``) and checks each call (`check_call`): the name exists, every keyword is a parameter,
  every required parameter is passed, no parameter gets two values, and records the real defaults the call
  relies on;
* checks every fake NPU object of the tests (`find_fakes`, `compare_fake`) against the same signatures;
* runs the release's meta (shape) function of each fused op we call on meta tensors with the shapes our
  processors pass (`run_meta`).

Everything here is plain functions over source text so that the tests can also feed it deliberately
wrong snippets and prove that each check fails. ``python tests/npu_contract.py fetch`` fetches the wheel
(what CI runs before pytest); ``python tests/npu_contract.py report`` prints the whole contract;
``python tests/npu_contract.py write-record`` rewrites ``tests/npu_contract_record.json``.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "hidream_ui"
TESTS_DIR = ROOT / "tests"
REQUIREMENTS_NPU = ROOT / "requirements_npu.txt"
RECORD_PATH = TESTS_DIR / "npu_contract_record.json"
# Set it to a torch_npu wheel file to read that one instead of fetching the pin (air-gapped machines, or
# checking a newer torch_npu before moving the pin: test_the_wheel_read_is_the_pinned_release then fails
# on purpose, and every other contract test says whether our calls and fakes still fit that release).
WHEEL_ENV = "HIDREAM_UI_NPU_WHEEL"
# The wheel is platform-specific but its Python sources are not; pinning the platform makes every
# machine (a macOS laptop included) fetch the same file.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"

# torchair ships inside torch_npu (torch_npu/dynamo/torchair) and imports itself as top-level
# `torchair`; both spellings name the same sources.
_ROOT_ALIASES = {"torch_npu": "torch_npu", "torchair": "torch_npu.dynamo.torchair"}
# Custom ops: torch_npu exports every torch.ops.npu op as torch_npu.<op> at import time
# (torch_npu/_init/core/_exports.py); their schemas are declared here.
_SCHEMA_FILES = (
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
    "torch_npu/csrc/aten/npu_native_functions.yaml",
)
_META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"


class ContractError(RuntimeError):
    """The contract cannot be checked (no wheel, unreadable release); the message says why."""


# ------------------------------------------------------------------------------------------------
# The pinned release


def pinned_versions(path: Path = REQUIREMENTS_NPU) -> dict[str, str]:
    """``{"torch": "2.13.0", "torch_npu": "2.13.0"}`` from the ``name==version`` lines of ``path``."""
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\s*(torch|torch[_-]npu)\s*==\s*([^\s#;]+)", line)
        if match:
            pins[match.group(1).replace("-", "_")] = match.group(2)
    for name in ("torch", "torch_npu"):
        if name not in pins:
            raise ContractError(f"{path} has no '{name}==<version>' line: the NPU contract reads its pin there")
    return pins


def cache_dir() -> Path:
    """``$HIDREAM_MODEL_CACHE/npu_contract`` (CI sets it per run), else ``~/.cache/hidream_ui/npu_contract``."""
    from hidream_ui.model.tiny.build import default_cache_root

    return default_cache_root() / "npu_contract"


def fetch_wheel(version: str, dest: Path, runner: Callable[..., Any] = subprocess.run) -> Path:
    """The ``torch_npu==version`` wheel in ``dest``, downloaded with ``pip download --no-deps`` unless there.

    Downloads into a temporary folder first and moves the file in, so an interrupted download never
    leaves a half wheel that a later run would trust. Raises `ContractError` with pip's own reason
    when the wheel cannot be fetched (no network, no such release). ``runner`` is ``subprocess.run``'s
    stand-in for tests.
    """
    dest = Path(dest)
    found = sorted(dest.glob(f"torch_npu-{version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    python = f"{sys.version_info.major}{sys.version_info.minor}"
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            WHEEL_PLATFORM,
            "--python-version",
            python,
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"torch_npu=={version}",
        ]
        try:
            done = runner(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ContractError(f"could not run {' '.join(command)}: {exc}") from exc
        wheels = sorted(Path(tmp).glob(f"torch_npu-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-6:])
            raise ContractError(
                f"could not fetch the torch_npu=={version} wheel (exit {done.returncode}) with "
                f"`{' '.join(command)}`:\n{tail or '(pip printed nothing)'}"
            )
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def release_wheel() -> Path:
    """The wheel of the pinned torch_npu: ``$HIDREAM_UI_NPU_WHEEL`` if set, else fetched into `cache_dir`."""
    version = pinned_versions()["torch_npu"]
    given = os.environ.get(WHEEL_ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise ContractError(f"{WHEEL_ENV}={given} is not a file")
        return path
    return fetch_wheel(version, cache_dir() / "wheels")


# ------------------------------------------------------------------------------------------------
# Signatures


class SourceDefault:
    """A default that is an expression, not a literal (e.g. ``{}`` is a literal, ``os.sep`` is not)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SourceDefault) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return SourceDefault(ast.unparse(node))


def signature_from_ast(args: ast.arguments, drop_first: bool = False) -> inspect.Signature:
    """The `inspect.Signature` of a ``def`` / ``lambda`` from its ``ast.arguments``; literal defaults."""
    P = inspect.Parameter
    params: list[inspect.Parameter] = []
    positional = list(args.posonlyargs) + list(args.args)
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=_default(default)))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=_default(default)))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    if drop_first:
        if not positional:
            raise ContractError("a method without a self parameter")
        params = params[1:]
    return inspect.Signature(params)


def signature_from_schema(schema: str) -> inspect.Signature:
    """The call signature of a ``torch.ops`` op from its schema (``name(Tensor a, *, float s=1.) -> ...``).

    Schema arguments before ``*`` may be passed by position or by name; after it by name only; defaults
    are the schema's (``1.`` -> 1.0, ``None``, ``True``, ``""`` ...).
    """
    from torchgen.model import FunctionSchema  # ships with torch: the parser torch's own codegen uses

    parsed = FunctionSchema.parse(schema)
    P = inspect.Parameter
    params = []
    for kind, arguments in (
        (P.POSITIONAL_OR_KEYWORD, parsed.arguments.flat_positional),
        (P.KEYWORD_ONLY, list(parsed.arguments.flat_kwarg_only) + list(parsed.arguments.out)),
    ):
        for argument in arguments:
            default: Any = P.empty
            if argument.default is not None:
                try:
                    default = ast.literal_eval(argument.default)
                except (ValueError, SyntaxError):
                    default = SourceDefault(argument.default)
            params.append(P(argument.name, kind, default=default))
    return inspect.Signature(params)


_POSITIONAL = object()  # placeholder values: only the shape of a call matters
_EXTRA_KEYWORD = "<any other keyword>"


def binds(signature: inspect.Signature, positional: int, keywords: Iterable[str]) -> str | None:
    """None if a call with ``positional`` positional and these keyword arguments binds, else why not."""
    keywords = list(keywords)
    P = inspect.Parameter
    if not any(p.kind == P.VAR_KEYWORD for p in signature.parameters.values()):
        # Named first: Python's own message would report a missing argument before an unknown keyword.
        unknown = [
            k
            for k in keywords
            if k not in signature.parameters or signature.parameters[k].kind in (P.POSITIONAL_ONLY, P.VAR_POSITIONAL)
        ]
        if unknown:
            return (
                f"got an unexpected keyword argument {unknown[0]!r} "
                f"(its parameters: {', '.join(signature.parameters) or 'none'})"
            )
    try:
        signature.bind(*[_POSITIONAL] * positional, **{name: _POSITIONAL for name in keywords})
    except TypeError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# The release, read from the wheel


@dataclass(frozen=True)
class Definition:
    """What a dotted torch_npu name is in the release.

    ``kind``: "function", "class", "module", "value" (assigned at import time: exists, signature unknown)
    or "op" (a torch.ops.npu custom op; ``schema`` is its declaration). ``signature`` is None where the
    release's sources do not tell it.
    """

    name: str
    kind: str
    file: str
    line: int
    signature: inspect.Signature | None = None
    schema: str | None = None


class Release:
    """A torch_npu wheel read as a zip file: nothing is extracted, installed or imported."""

    def __init__(self, wheel: Path):
        self.wheel = Path(wheel)
        try:
            self._zip = zipfile.ZipFile(self.wheel)
            self._names = set(self._zip.namelist())
        except (OSError, zipfile.BadZipFile) as exc:
            raise ContractError(f"{self.wheel} is not a readable wheel ({exc}); delete it to fetch it again") from exc
        version_source = self.text("torch_npu/version.py")
        match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", version_source or "", re.M)
        if not match:
            raise ContractError(f"{self.wheel} has no torch_npu/version.py with __version__: not a torch_npu wheel")
        self.version = match.group(1)
        self._modules: dict[str, tuple[str, ast.Module] | None] = {}
        self._schemas: dict[str, tuple[str, str]] | None = None

    def text(self, path: str) -> str | None:
        if path not in self._names:
            return None
        return self._zip.read(path).decode("utf-8")

    def module(self, dotted: str) -> tuple[str, ast.Module] | None:
        """(file, parsed source) of the module ``dotted`` (``torch_npu.npu`` -> torch_npu/npu/__init__.py)."""
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            self._modules[dotted] = None
            for path in (f"{base}/__init__.py", f"{base}.py"):
                source = self.text(path)
                if source is not None:
                    self._modules[dotted] = (path, ast.parse(source, filename=path))
                    break
        return self._modules[dotted]

    def is_package(self, dotted: str) -> bool:
        found = self.module(dotted)
        return found is not None and found[0].endswith("/__init__.py")

    def schemas(self) -> dict[str, tuple[str, str]]:
        """``{op name: (schema, file)}`` of the custom ops (default overloads only: names without a dot)."""
        if self._schemas is None:
            self._schemas = {}
            for path in _SCHEMA_FILES:
                for match in re.finditer(r"^\s*(?:-\s*)?func:\s*(([A-Za-z_][\w]*)\(.*)$", self.text(path) or "", re.M):
                    self._schemas.setdefault(match.group(2), (match.group(1).strip(), path))
        return self._schemas

    # -- name resolution -------------------------------------------------------------------------
    def resolve(self, dotted: str) -> Definition | None:
        """The definition ``dotted`` (``torch_npu.npu.mem_get_info``) names in this release, or None."""
        parts = dotted.split(".")
        if parts[0] != "torch_npu":
            raise ContractError(f"{dotted!r} is not a torch_npu name")
        current: Definition | None = Definition("torch_npu", "module", "torch_npu/__init__.py", 1)
        for part in parts[1:]:
            current = self._member(current, part, set()) if current is not None else None
        return current

    def _member(self, owner: Definition, name: str, seen: set) -> Definition | None:
        if (owner.name, name) in seen:
            return None
        seen.add((owner.name, name))
        qualified = f"{owner.name}.{name}"
        if owner.kind == "class":
            return self._class_member(owner, name)
        if owner.kind != "module":
            return None
        found = self.module(owner.name)
        binding = None
        if found is not None:
            path, tree = found
            binding = self._module_binding(owner.name, path, tree, name, seen)
        if binding is not None:
            return binding
        if self.module(qualified) is not None:
            path = self.module(qualified)[0]
            return Definition(qualified, "module", path, 1)
        if owner.name == "torch_npu" and name in self.schemas():
            schema, path = self.schemas()[name]
            line = (self.text(path) or "").count("\n", 0, (self.text(path) or "").find(schema)) + 1
            return Definition(qualified, "op", path, line, signature_from_schema(schema), schema)
        return None

    def _module_binding(self, module: str, path: str, tree: ast.Module, name: str, seen: set) -> Definition | None:
        """The last top-level binding of ``name`` in ``module`` (Python semantics: the last one wins)."""
        result: Definition | None = None
        qualified = f"{module}.{name}"
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                result = Definition(qualified, "function", path, node.lineno, signature_from_ast(node.args))
            elif isinstance(node, ast.ClassDef) and node.name == name:
                result = self._class(qualified, path, node, module)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
                    alias = None
                    if isinstance(node.value, ast.Name) and node.value.id != name:
                        alias = self._member(Definition(module, "module", path, 1), node.value.id, seen)
                    result = alias or Definition(qualified, "value", path, node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        target = alias.name if alias.asname else alias.name.split(".")[0]
                        target = _canonical_module(target)
                        if target and self.module(target) is not None:
                            result = Definition(target, "module", self.module(target)[0], 1)
            elif isinstance(node, ast.ImportFrom):
                source = _import_from_module(module, self.is_package(module), node)
                if source is None:
                    continue
                for alias in node.names:
                    if alias.name == "*":
                        if self._star_exports(source, name):
                            found = self._member(Definition(source, "module", path, 1), name, seen)
                            result = found or result
                    elif (alias.asname or alias.name) == name:
                        found = self._member(Definition(source, "module", path, 1), alias.name, seen)
                        result = found or result
        return result

    def _star_exports(self, module: str, name: str) -> bool:
        found = self.module(module)
        if found is None:
            return False
        for node in _top_level(found[1].body):
            names = [t for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)]
            if isinstance(node, ast.Assign) and any(t.id == "__all__" for t in names):
                try:
                    return name in ast.literal_eval(node.value)
                except ValueError:
                    return not name.startswith("_")
        return not name.startswith("_")

    def _class(self, qualified: str, path: str, node: ast.ClassDef, module: str) -> Definition:
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        signature = signature_from_ast(init.args, drop_first=True) if init is not None else None
        if init is None:
            # Inherited __init__: follow the first base the sources define, else object's ().
            for base in node.bases:
                if isinstance(base, ast.Name):
                    found = self._member(Definition(module, "module", path, 1), base.id, set())
                    if found is not None and found.kind == "class":
                        signature = found.signature
                        break
            else:
                signature = inspect.Signature([]) if not node.bases else None
        return Definition(qualified, "class", path, node.lineno, signature)

    def _class_member(self, owner: Definition, name: str) -> Definition | None:
        found = self.module(owner.name.rsplit(".", 1)[0])
        if found is None:
            return None
        for node in ast.walk(found[1]):
            if isinstance(node, ast.ClassDef) and node.lineno == owner.line:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == name:
                        return Definition(
                            f"{owner.name}.{name}",
                            "function",
                            owner.file,
                            item.lineno,
                            signature_from_ast(item.args, drop_first=True),
                        )
        return None

    # -- meta functions --------------------------------------------------------------------------
    def meta_function(self, op: str) -> ast.FunctionDef | None:
        """The ``@impl(m, "<op>")`` meta (shape) function of ``op`` in op_plugin's meta registrations."""
        source = self.text(_META_FILE)
        if source is None:
            return None
        for node in ast.parse(source, filename=_META_FILE).body:
            if isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    if (
                        isinstance(decorator, ast.Call)
                        and len(decorator.args) >= 2
                        and isinstance(decorator.args[1], ast.Constant)
                        and decorator.args[1].value == op
                    ):
                        return node
        return None


def _top_level(body: Sequence[ast.stmt]) -> Iterable[ast.stmt]:
    """Top-level statements, looking into module-level ``if`` / ``try`` blocks (conditional definitions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        else:
            yield node


def _canonical_module(name: str) -> str | None:
    """``torchair.x`` -> ``torch_npu.dynamo.torchair.x``; ``torch_npu.x`` unchanged; others None."""
    root, _, rest = name.partition(".")
    if root not in _ROOT_ALIASES:
        return None
    return _ROOT_ALIASES[root] + ("." + rest if rest else "")


def _import_from_module(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return _canonical_module(node.module or "")
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        package = package[: -(node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


# ------------------------------------------------------------------------------------------------
# What the project calls, derived from its sources


@dataclass(frozen=True)
class Use:
    """One use of a torch_npu name in the project: a call (with its shape) or a reference.

    ``where`` is ``path:line``; ``context`` is ``Class.method`` or ``function`` (the class is the concrete
    one: `_TorchAcceleratorBackend.mem_get_info` analysed for `NPUBackend` is ``NPUBackend.mem_get_info``).
    """

    target: str
    where: str
    context: str
    call: bool
    positional: int = 0
    keywords: tuple[str, ...] = ()
    star_args: bool = False
    star_kwargs: bool = False

    @property
    def key(self) -> str:
        """Stable across edits that only move lines: used by the recorded defaults."""
        return f"{self.where.rsplit(':', 1)[0]}::{self.context} -> {self.target}"

    def describe(self) -> str:
        if not self.call:
            return f"{self.target} (referenced)"
        args = ["<arg>"] * self.positional + [f"{k}=" for k in self.keywords]
        args += ["*args"] if self.star_args else []
        args += ["**kwargs"] if self.star_kwargs else []
        return f"{self.target}({', '.join(args)})"


@dataclass(frozen=True)
class Injection:
    """A constructor parameter of a project class through which tests replace a torch_npu object.

    ``kind`` "is": the argument stands for ``target`` itself (``NpuFusionProcessor(fusion_fn=...)`` for
    ``torch_npu.npu_fusion_attention``); "returns": the argument is a callable whose result stands for
    ``target`` (``NPUBackend(import_module=...)`` returns ``torch_npu``).
    """

    owner: str
    parameter: str
    kind: str
    target: str
    path: str = ""


@dataclass
class ProjectScan:
    uses: list[Use] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)

    @property
    def calls(self) -> list[Use]:
        return [use for use in self.uses if use.call]

    def targets(self) -> list[str]:
        return sorted({use.target for use in self.uses})


_IMPORTER_NAME = re.compile(r"import", re.I)


class _ModuleScanner:
    """Follows which expressions in one module stand for torch_npu objects.

    A value stands for a torch_npu name when it comes from ``import torch_npu`` / ``import torchair`` /
    ``from torch_npu... import x``, from ``torch.npu`` (torch_npu registers torch_npu.npu there), from a
    dynamic import of ``"torch_npu..."`` (``importlib.import_module("torch_npu")``, an injected importer
    called ``self._import("torch_npu")``, ``sys.modules.get("torch_npu")``), from ``getattr`` on such a
    value, or from a ``self.method()`` whose method returns one (looked up in the concrete class and its
    bases in the same module). Local assignments carry the meaning through.
    """

    def __init__(self, tree: ast.Module, path: str):
        self.tree = tree
        self.path = path
        self.classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        self.functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        self.module_env: dict[str, str] = {}
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self._bind_imports(node, self.module_env)
        self.uses: dict[tuple, Use] = {}
        self.injections: dict[tuple, Injection] = {}
        self._returns: dict[tuple, str | None] = {}

    # -- environments ------------------------------------------------------------------------
    def _bind_imports(self, root: ast.AST, env: dict[str, str]) -> None:
        nodes = (
            [root]
            if isinstance(root, (ast.Import, ast.ImportFrom))
            else [n for n in _walk_same_scope(root) if isinstance(n, (ast.Import, ast.ImportFrom))]
        )
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        target = "torch" if alias.name == "torch" else _canonical_module(alias.name)
                        if alias.name == "torch.npu":
                            target = "torch_npu.npu"
                        if target:
                            env[alias.asname] = target
                    else:
                        root_name = alias.name.split(".")[0]
                        target = "torch" if root_name == "torch" else _canonical_module(root_name)
                        if target:
                            env[root_name] = target
            elif node.level == 0 and node.module:
                base = "torch_npu" if node.module == "torch" else _canonical_module(node.module)
                if node.module == "torch.npu":
                    base = "torch_npu.npu"
                for alias in node.names:
                    if base is None or alias.name == "*":
                        continue
                    if node.module == "torch" and alias.name != "npu":
                        continue
                    env[alias.asname or alias.name] = f"{base}.{alias.name}"

    def _env(self, function: ast.AST | None, cls: str | None, outer: Mapping[str, str] | None = None) -> dict[str, str]:
        """Names standing for torch_npu objects inside ``function``: ``outer`` (the enclosing function's,
        for closures; else the module's) plus the function's own imports and assignments."""
        env = dict(self.module_env if outer is None else outer)
        if function is None:
            return env
        self._bind_imports(function, env)
        for _ in range(2):  # twice: an assignment may use a name bound later in the source
            for node in _walk_same_scope(function):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    value = self._eval(node.value, env, cls)
                    if value is not None:
                        env[node.targets[0].id] = value
        return env

    # -- classes -------------------------------------------------------------------------------
    def _mro(self, cls: str) -> list[ast.ClassDef]:
        order, todo = [], [cls]
        while todo:
            name = todo.pop(0)
            node = self.classes.get(name)
            if node is None or node in order:
                continue
            order.append(node)
            todo.extend(base.id for base in node.bases if isinstance(base, ast.Name))
        return order

    def _method(self, cls: str, name: str) -> ast.FunctionDef | None:
        for node in self._mro(cls):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
        return None

    def _method_return(self, method: ast.FunctionDef, cls: str | None) -> str | None:
        key = (id(method), cls)
        if key in self._returns:
            return self._returns[key]
        self._returns[key] = None  # recursion guard
        env = self._env(method, cls)
        found, self_attributes = None, []
        for node in _walk_same_scope(method):
            if isinstance(node, ast.Return) and node.value is not None:
                value = self._eval(node.value, env, cls)
                found = found or value
                if _is_self_attribute(node.value):
                    self_attributes.append(node.value.attr)
        if found and cls:
            for attribute in self_attributes:
                self._inject(cls, attribute, "is", found)
        self._returns[key] = found
        return found

    def _inject(self, cls: str, attribute: str, kind: str, target: str) -> None:
        """Records that ``self.<attribute>`` stands for ``target``, by the constructor parameter it comes from."""
        init = self._method(cls, "__init__")
        if init is None:
            return
        parameters = {a.arg for a in init.args.args + init.args.kwonlyargs}
        for node in _walk_same_scope(init):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and _is_self_attribute(node.targets[0])
                and node.targets[0].attr == attribute
            ):
                value = node.value.values[0] if isinstance(node.value, ast.BoolOp) else node.value
                if isinstance(value, ast.Name) and value.id in parameters:
                    self.injections[(cls, value.id)] = Injection(cls, value.id, kind, target, self.path)

    # -- expressions -----------------------------------------------------------------------------
    def _eval(self, node: ast.AST, env: Mapping[str, str], cls: str | None) -> str | None:
        """The torch_npu name ``node`` stands for ("torch" for the torch module itself), else None."""
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._eval(node.value, env, cls)
            if base == "torch":
                return "torch_npu.npu" if node.attr == "npu" else None
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.BoolOp):
            return next((v for v in (self._eval(x, env, cls) for x in node.values) if v), None)
        if isinstance(node, ast.IfExp):
            return self._eval(node.body, env, cls) or self._eval(node.orelse, env, cls)
        if isinstance(node, ast.Subscript):  # sys.modules["torch_npu"]
            if _dotted(node.value) == "sys.modules" and isinstance(node.slice, ast.Constant):
                return _canonical_module(str(node.slice.value))
            return None
        if isinstance(node, ast.Call):
            return self._eval_call(node, env, cls)
        return None

    def _eval_call(self, node: ast.Call, env: Mapping[str, str], cls: str | None) -> str | None:
        func = node.func
        first = node.args[0] if node.args else None
        module_name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if module_name is not None and (_IMPORTER_NAME.search(callee) or _dotted(func) == "sys.modules.get"):
            target = _canonical_module(module_name)
            if target and cls and _is_self_attribute(func):
                self._inject(cls, func.attr, "returns", target)
            return target
        if callee == "getattr" and isinstance(func, ast.Name) and len(node.args) >= 2:
            base, name = self._eval(node.args[0], env, cls), node.args[1]
            if base and isinstance(name, ast.Constant) and isinstance(name.value, str):
                return f"{base}.{name.value}"
            return None
        if cls and _is_self_attribute(func):
            method = self._method(cls, func.attr)
            return self._method_return(method, cls) if method is not None else None
        if isinstance(func, ast.Name) and func.id in self.functions and func.id not in env:
            return self._method_return(self.functions[func.id], None)  # a module-level helper
        return None

    # -- uses ------------------------------------------------------------------------------------
    def scan(self) -> None:
        self._scan_body(self.tree, self.module_env, None, "<module>")
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._scan_function(node, None, node.name)
        for cls in self.classes:
            seen = set()
            for klass in self._mro(cls):
                for item in klass.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name not in seen:
                        seen.add(item.name)
                        self._scan_function(item, cls, f"{cls}.{item.name}")

    def _scan_function(
        self, function: ast.AST, cls: str | None, context: str, outer: Mapping[str, str] | None = None
    ) -> None:
        env = self._env(function, cls, outer)
        self._scan_body(function, env, cls, context)
        for node in _walk_same_scope(function):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not function:
                self._scan_function(node, cls, f"{context}.{node.name}", env)

    def _scan_body(self, root: ast.AST, env: Mapping[str, str], cls: str | None, context: str) -> None:
        called = set()
        for node in _walk_same_scope(root):
            if isinstance(node, ast.Call):
                target = self._eval(node.func, env, cls)
                if target and target != "torch":
                    called.add(id(node.func))
                    self._add(
                        Use(
                            target,
                            f"{self.path}:{node.lineno}",
                            context,
                            True,
                            len([a for a in node.args if not isinstance(a, ast.Starred)]),
                            tuple(k.arg for k in node.keywords if k.arg is not None),
                            any(isinstance(a, ast.Starred) for a in node.args),
                            any(k.arg is None for k in node.keywords),
                        )
                    )
                if (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr")
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                ):
                    base = self._eval(node.args[0], env, cls)
                    if base and base != "torch":
                        self._add(Use(f"{base}.{node.args[1].value}", f"{self.path}:{node.lineno}", context, False))
            elif isinstance(node, ast.Attribute) and id(node) not in called:
                target = self._eval(node, env, cls)
                if target and target != "torch" and isinstance(node.ctx, ast.Load):
                    self._add(Use(target, f"{self.path}:{node.lineno}", context, False))

    def _add(self, use: Use) -> None:
        key = (use.where, use.target, use.call, use.context)
        self.uses.setdefault(key, use)


def _walk_same_scope(root: ast.AST) -> Iterable[ast.AST]:
    """Nodes of ``root`` without descending into nested defs/classes (other scopes; lambdas are included)."""
    todo = list(ast.iter_child_nodes(root))
    while todo:
        node = todo.pop(0)
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _is_self_attribute(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def scan_source(source: str, path: str = "<snippet>") -> ProjectScan:
    """The torch_npu uses and injection points of one module's source."""
    scanner = _ModuleScanner(ast.parse(source, filename=path), path)
    scanner.scan()
    # A reference that is only the prefix of a longer use (torch_npu.npu in torch_npu.npu.set_device)
    # says nothing more; keep references only where nothing longer was used on the same line.
    uses = list(scanner.uses.values())
    longer = {(u.where, prefix) for u in uses for prefix in _prefixes(u.target)}
    uses = [u for u in uses if u.call or (u.where, u.target) not in longer]
    return ProjectScan(sorted(uses, key=lambda u: (u.where, u.target)), list(scanner.injections.values()))


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def scan_project(package_dir: Path = PACKAGE_DIR) -> ProjectScan:
    """Every torch_npu / torch.npu / torchair use in ``hidream_ui/**/*.py``."""
    result = ProjectScan()
    for path in sorted(package_dir.rglob("*.py")):
        scan = scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
        result.uses.extend(scan.uses)
        result.injections.extend(scan.injections)
    return result


# ------------------------------------------------------------------------------------------------
# Checking calls


@dataclass(frozen=True)
class CallCheck:
    """``passed``: the real parameters the call's arguments bind to, in order; ``relied_defaults``: the
    real defaults of the parameters it leaves out."""

    use: Use
    definition: Definition | None
    problems: tuple[str, ...]
    relied_defaults: Mapping[str, Any]
    passed: tuple[str, ...] = ()


def check_use(use: Use, release: Release) -> CallCheck:
    """Checks one use against ``release``: the name exists; a call binds to the real signature.

    Binding means the keywords are parameters, no parameter gets two values, positional arguments fit
    and every parameter without a default is given. ``relied_defaults`` are the real defaults of the
    parameters the call leaves out.
    """
    definition = release.resolve(use.target)
    where = f"{use.where} ({use.context})"
    if definition is None:
        return CallCheck(use, None, (f"{where}: torch_npu {release.version} has no {use.target}",), {})
    if not use.call:
        return CallCheck(use, definition, (), {})
    if definition.signature is None:
        return CallCheck(
            use,
            definition,
            (
                f"{where}: calls {use.describe()} but torch_npu {release.version} defines {use.target} as a "
                f"{definition.kind} ({definition.file}:{definition.line}) whose signature its sources do not give",
            ),
            {},
        )
    if use.star_args or use.star_kwargs:
        return CallCheck(
            use,
            definition,
            (
                f"{where}: {use.describe()} passes *args/**kwargs, which cannot be checked against "
                f"{use.target}{definition.signature}: pass the arguments explicitly",
            ),
            {},
        )
    why = binds(definition.signature, use.positional, use.keywords)
    if why is not None:
        return CallCheck(
            use,
            definition,
            (
                f"{where}: {use.describe()} is refused by torch_npu {release.version}'s {use.target}"
                f"{definition.signature} ({definition.file}:{definition.line}): {why}",
            ),
            {},
        )
    bound = definition.signature.bind(*[_POSITIONAL] * use.positional, **{k: _POSITIONAL for k in use.keywords})
    relied = {
        name: p.default
        for name, p in definition.signature.parameters.items()
        if name not in bound.arguments and p.default is not inspect.Parameter.empty
    }
    return CallCheck(use, definition, (), relied, tuple(bound.arguments))


def record(checks: Sequence[CallCheck], version: str) -> dict:
    """The JSON-able record of what each call passes and which real defaults it relies on."""
    calls: dict[str, dict] = {}
    for check in checks:
        if check.use.call and not check.problems:
            calls[check.use.key] = {
                "passed": [
                    f"{name} (by {'keyword' if name in check.use.keywords else 'position'})" for name in check.passed
                ],
                "relied_defaults": {k: repr(v) for k, v in sorted(check.relied_defaults.items())},
            }
    return {"torch_npu": version, "calls": dict(sorted(calls.items()))}


# ------------------------------------------------------------------------------------------------
# Fakes


def compare_fake(fake: inspect.Signature, real: inspect.Signature) -> list[str]:
    """Why ``fake`` is not a safe stand-in for ``real`` (empty when it is).

    The rule: every call the fake accepts, the real function accepts too, and every parameter that is
    optional in both has the same default. Counted by call shape (how many positional arguments, which
    keywords), so a fake may be *stricter* than the real function (positional-only, fewer optional
    parameters: a test that calls it differently fails loudly) but never more lenient: no keyword the
    real one lacks (``**kwargs`` included), no parameter optional that the real one requires, no extra
    positional slot, no parameter names in another order. Checked exhaustively over the call shapes that
    can tell the two apart: for each positional count, the keywords the fake requires at that count,
    plus at most one optional keyword (any refusal needs just one offending keyword, or none).
    """
    P = inspect.Parameter
    fake_params = list(fake.parameters.values())
    positional = [p for p in fake_params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keywordable = [p.name for p in fake_params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    var_positional = any(p.kind == P.VAR_POSITIONAL for p in fake_params)
    var_keyword = any(p.kind == P.VAR_KEYWORD for p in fake_params)
    problems: dict[str, str] = {}
    for count in range(len(positional) + (2 if var_positional else 1)):
        covered = {p.name for p in positional[:count]}
        required = [
            p
            for p in fake_params
            if p.default is P.empty
            and p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
            and p.name not in covered
        ]
        if any(p.kind == P.POSITIONAL_ONLY for p in required):
            continue  # the fake refuses every call with this many positional arguments
        forced = [p.name for p in required]
        extras: list[str | None] = [None] + [n for n in keywordable if n not in covered and n not in forced]
        if var_keyword:
            extras.append(_EXTRA_KEYWORD)
        for extra in extras:
            keywords = forced + ([extra] if extra else [])
            if binds(fake, count, keywords) is not None:
                continue
            why = binds(real, count, keywords)
            if why is not None and why not in problems:
                shown = ", ".join(["<arg>"] * count + [f"{k}=" for k in keywords])
                problems[why] = f"the fake accepts ({shown}) but the real one refuses it: {why}"
    for name, p in fake.parameters.items():
        r = real.parameters.get(name)
        if r is None or p.default is P.empty or r.default is P.empty:
            continue
        if not _same_default(p.default, r.default):
            problems[f"default {name}"] = (
                f"the fake's default {name}={p.default!r} differs from the real {name}={r.default!r}"
            )
    return list(problems.values())


def _same_default(a: Any, b: Any) -> bool:
    # 1 == 1.0 behaves alike as a default; True == 1 does not (a flag is not a count).
    return isinstance(a, bool) == isinstance(b, bool) and a == b


@dataclass(frozen=True)
class Fake:
    """A test object standing in for a real one; ``target`` names what it fakes.

    ``target`` is a torch_npu name, or ``hidream_ui.device.backends.NPUBackend.<method>`` for the fake backends.
    ``label`` is ``tests/file.py::Class.method``.
    """

    label: str
    target: str
    signature: inspect.Signature | None
    line: int


@dataclass
class _TestModule:
    path: str
    tree: ast.Module
    parents: dict[int, ast.AST]


def _load_test_modules(sources: Mapping[str, str]) -> list[_TestModule]:
    modules = []
    for path, source in sources.items():
        tree = ast.parse(source, filename=path)
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        modules.append(_TestModule(path, tree, parents))
    return modules


def _enclosing_scopes(module: _TestModule, node: ast.AST) -> list[ast.AST]:
    scopes, current = [], module.parents.get(id(node))
    while current is not None:
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            scopes.append(current)
        current = module.parents.get(id(current))
    return scopes


def _find_class(modules: Sequence[_TestModule], module: _TestModule, node: ast.AST, name: str):
    """The class ``name`` visible at ``node``: the innermost enclosing scope first, then other test files."""
    for scope in _enclosing_scopes(module, node):
        for item in _walk_same_scope(scope):
            if isinstance(item, ast.ClassDef) and item.name == name:
                return module, item
    for other in modules:
        for item in other.tree.body:
            if isinstance(item, ast.ClassDef) and item.name == name:
                return other, item
    return None


def _class_methods(modules, module, cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """Methods of ``cls`` including those inherited from test classes (subclass wins)."""
    methods: dict[str, ast.FunctionDef] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _find_class(modules, module, cls, base.id)
            if found is not None:
                methods.update(_class_methods(modules, found[0], found[1]))
    methods.update({item.name: item for item in cls.body if isinstance(item, ast.FunctionDef)})
    return methods


def _class_attribute(modules, module, cls: ast.ClassDef, name: str) -> Any:
    for item in cls.body:
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
            return _default(item.value)
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _find_class(modules, module, cls, base.id)
            if found is not None:
                value = _class_attribute(modules, found[0], found[1], name)
                if value is not None:
                    return value
    return None


def _value_class(modules, module, expr: ast.AST):
    """The test class whose instance ``expr`` is (``Cls(...)`` or a name assigned from one), or None."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        return _find_class(modules, module, expr, expr.func.id)
    if isinstance(expr, ast.Name):
        for scope in _enclosing_scopes(module, expr):
            for item in _walk_same_scope(scope):
                if (
                    isinstance(item, ast.Assign)
                    and len(item.targets) == 1
                    and isinstance(item.targets[0], ast.Name)
                    and item.targets[0].id == expr.id
                    and isinstance(item.value, ast.Call)
                ):
                    return _value_class(modules, module, item.value)
    return None


def _returned_expressions(module: _TestModule, expr: ast.AST) -> list[ast.AST]:
    """What the callable ``expr`` (a lambda, or the name of a def) returns."""
    if isinstance(expr, ast.Lambda):
        return [expr.body]
    if isinstance(expr, ast.Name):
        for scope in _enclosing_scopes(module, expr):
            for item in _walk_same_scope(scope):
                if isinstance(item, ast.FunctionDef) and item.name == expr.id:
                    return [
                        n.value for n in _walk_same_scope(item) if isinstance(n, ast.Return) and n.value is not None
                    ]
    return []


def _object_fakes(
    modules, module, cls: ast.ClassDef, target: str, call: ast.Call | None, call_module: _TestModule | None = None
) -> list[Fake]:
    """An instance of ``cls`` (defined in ``module``) stands for the torch_npu object ``target``.

    Its public methods fake ``target.<method>``; a constructor parameter stored as ``self.<attr>`` fakes
    ``target.<attr>``, and when ``call`` (the ``cls(...)`` expression, in ``call_module``) passes an
    instance of a test class for it, that instance is an object fake of ``target.<attr>`` in turn.
    """
    label = f"{module.path}::{cls.name}"
    fakes = []
    methods = _class_methods(modules, module, cls)
    for name, method in sorted(methods.items()):
        if name.startswith("_"):
            continue
        fakes.append(
            Fake(f"{label}.{name}", f"{target}.{name}", signature_from_ast(method.args, drop_first=True), method.lineno)
        )
    init = methods.get("__init__")
    if init is not None:
        parameters = [a.arg for a in init.args.args[1:]]
        for node in _walk_same_scope(init):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and _is_self_attribute(node.targets[0])
                and isinstance(node.value, ast.Name)
                and node.value.id in parameters
            ):
                attribute = node.targets[0].attr
                fakes.append(Fake(f"{label}.{attribute}", f"{target}.{attribute}", None, node.lineno))
                if call is not None:
                    index = parameters.index(node.value.id)
                    argument = (
                        call.args[index]
                        if index < len(call.args)
                        else next((k.value for k in call.keywords if k.arg == node.value.id), None)
                    )
                    inner = _value_class(modules, call_module, argument) if argument is not None else None
                    if inner is not None:
                        fakes.extend(
                            _object_fakes(
                                modules,
                                inner[0],
                                inner[1],
                                f"{target}.{attribute}",
                                argument if isinstance(argument, ast.Call) else None,
                                call_module,
                            )
                        )
    return fakes


def find_fakes(
    sources: Mapping[str, str], injections: Sequence[Injection], backend_methods: Iterable[str] = ()
) -> list[Fake]:
    """Every fake NPU object in the test ``sources`` (``{path: source}``), found by how tests inject it.

    * A value passed for an injection parameter of the project (`Injection`, derived from the project's
      code: ``fusion_fn=``, ``import_module=``, as a keyword or a ``{"name": value}`` options entry):
      kind "is": the value's class ``__call__`` (or the def) fakes the target; kind "returns": the object
      the callable returns fakes the target module (`_object_fakes`).
    * A test class whose ``type`` class attribute is ``"npu"`` stands in for the project's NPU backend
      (the backend table is keyed by that type): its methods named in ``backend_methods`` (the `Backend`
      protocol, see `backend_protocol`) fake ``hidream_ui.device.backends.NPUBackend``'s; other methods are
      test helpers (``calls_to``).
    """
    backend_methods = set(backend_methods)
    modules = _load_test_modules(sources)
    by_parameter = {i.parameter: i for i in injections}
    fakes: dict[tuple, Fake] = {}

    def add(found: Iterable[Fake]) -> None:
        for fake in found:
            fakes.setdefault((fake.label, fake.target), fake)

    for module in modules:
        for node in ast.walk(module.tree):
            pairs: list[tuple[str, ast.AST]] = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords if k.arg in by_parameter]
            elif isinstance(node, ast.Dict):
                pairs = [
                    (k.value, v)
                    for k, v in zip(node.keys, node.values)
                    if isinstance(k, ast.Constant) and k.value in by_parameter
                ]
            for parameter, value in pairs:
                injection = by_parameter[parameter]
                if injection.kind == "is":
                    if isinstance(value, ast.Lambda):
                        add(
                            [
                                Fake(
                                    f"{module.path}:{value.lineno}::<lambda>",
                                    injection.target,
                                    signature_from_ast(value.args),
                                    value.lineno,
                                )
                            ]
                        )
                        continue
                    found = _value_class(modules, module, value)
                    if found is not None:
                        call = _class_methods(modules, found[0], found[1]).get("__call__")
                        add(
                            [
                                Fake(
                                    f"{found[0].path}::{found[1].name}.__call__",
                                    injection.target,
                                    signature_from_ast(call.args, drop_first=True) if call else None,
                                    found[1].lineno,
                                )
                            ]
                        )
                else:
                    for returned in _returned_expressions(module, value):
                        found = _value_class(modules, module, returned)
                        if found is not None:
                            add(
                                _object_fakes(
                                    modules,
                                    found[0],
                                    found[1],
                                    injection.target,
                                    returned if isinstance(returned, ast.Call) else None,
                                    module,
                                )
                            )
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and _class_attribute(modules, module, node, "type") == "npu":
                for name, method in sorted(_class_methods(modules, module, node).items()):
                    if name in backend_methods:
                        add(
                            [
                                Fake(
                                    f"{module.path}::{node.name}.{name}",
                                    f"hidream_ui.device.backends.NPUBackend.{name}",
                                    signature_from_ast(method.args, drop_first=True),
                                    method.lineno,
                                )
                            ]
                        )
    return sorted(fakes.values(), key=lambda f: (f.label, f.target))


def backend_protocol() -> dict[str, inspect.Signature]:
    """``{method: signature}`` of `hidream_ui.device.backends.Backend` as `NPUBackend` implements it."""
    from hidream_ui.device import backends as devices_backends

    real_class = type(devices_backends.default_backends()["npu"])  # constructing a backend touches no device
    names = [n for n, v in vars(devices_backends.Backend).items() if inspect.isfunction(v) and not n.startswith("_")]
    result = {}
    for name in names:
        signature = inspect.signature(getattr(real_class, name))
        result[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return result


@dataclass(frozen=True)
class FakeCheck:
    fake: Fake
    problems: tuple[str, ...]


def check_fake(fake: Fake, release: Release, protocol: Mapping[str, inspect.Signature]) -> FakeCheck:
    prefix = "hidream_ui.device.backends.NPUBackend."
    if fake.target.startswith(prefix):
        name = fake.target[len(prefix) :]
        if name not in protocol:
            return FakeCheck(fake, (f"{fake.label} fakes NPUBackend.{name}, which is not a Backend method",))
        problems = compare_fake(fake.signature, protocol[name])
        return FakeCheck(fake, tuple(f"{fake.label} (fake of {fake.target}): {p}" for p in problems))
    definition = release.resolve(fake.target)
    if definition is None:
        return FakeCheck(fake, (f"{fake.label} fakes {fake.target}, which torch_npu {release.version} does not have",))
    if fake.signature is None or definition.kind in ("module", "value"):
        return FakeCheck(fake, ())  # an attribute: existing is all it must do
    if definition.signature is None:
        return FakeCheck(
            fake, (f"{fake.label} fakes {fake.target}, whose signature the release's sources do not give",)
        )
    problems = compare_fake(fake.signature, definition.signature)
    return FakeCheck(fake, tuple(f"{fake.label} (fake of {fake.target}{definition.signature}): {p}" for p in problems))


def sources_of_tests(tests_dir: Path = TESTS_DIR) -> dict[str, str]:
    """The test files whose fakes are checked; this contract's own files (synthetic fakes) excluded."""
    return {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in sorted(tests_dir.glob("*.py"))
        if not p.name.startswith(("npu_contract", "test_npu_contract"))
    }


# ------------------------------------------------------------------------------------------------
# Meta (shape) functions


class MetaUnavailable(ContractError):
    """The release's meta function cannot run on plain torch; the message says what it needs."""


# Helpers a meta function may call that do nothing to shapes, with why they can be stubbed. Any other
# name the function needs from torch_npu makes it MetaUnavailable (reported, never guessed).
META_STUBS: Mapping[str, tuple[Callable[..., Any], str]] = {
    "_warn_npu_fusion_attention_compile_once": (
        lambda: None,
        "prints a torch.compile caveat on Ascend950 only; it reads the SoC version from torch_npu's C extension",
    ),
}


def meta_callable(release: Release, op: str) -> Callable[..., Any]:
    """The release's meta function of ``op``, compiled from its source with decorators removed.

    Its free names must be torch or a `META_STUBS` entry; anything else (torch_npu's C extension, other
    helpers) raises `MetaUnavailable` naming it.
    """
    node = release.meta_function(op)
    if node is None:
        raise MetaUnavailable(f"torch_npu {release.version} registers no meta function for {op} in {_META_FILE}")
    stripped = copy.deepcopy(node)
    stripped.decorator_list = []  # @impl(m, ...) registers with torch_npu's library; we only want the body
    free = sorted(_free_names(stripped) - set(dir(builtins)) - {"torch"})
    missing = [name for name in free if name not in META_STUBS]
    if missing:
        raise MetaUnavailable(
            f"the meta function of {op} ({_META_FILE}:{node.lineno}) needs {', '.join(missing)} "
            "from torch_npu, which cannot be imported without CANN"
        )
    import torch

    module = ast.Module([stripped], [])
    namespace: dict[str, Any] = {"torch": torch, **{name: META_STUBS[name][0] for name in free}}
    exec(compile(module, f"{release.wheel.name}/{_META_FILE}", "exec"), namespace)  # noqa: S102 - the release's own source
    return namespace[node.name]


def _free_names(function: ast.FunctionDef) -> set[str]:
    bound = {a.arg for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs}
    bound |= {a.arg for a in (function.args.vararg, function.args.kwarg) if a is not None}
    loaded = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name):
            (bound.add if isinstance(node.ctx, (ast.Store, ast.Del)) else loaded.add)(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and node is not function:
            bound |= {a.arg for a in node.args.args + node.args.kwonlyargs}
        elif isinstance(node, ast.comprehension):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return loaded - bound


def meta_matches_schema(release: Release, op: str) -> list[str]:
    """Where the meta function's parameters disagree with the op's schema (names, order, defaults)."""
    node = release.meta_function(op)
    definition = release.resolve(f"torch_npu.{op}")
    if node is None or definition is None or definition.signature is None:
        return [f"{op}: meta function or schema missing"]
    meta, schema = signature_from_ast(node.args), definition.signature
    problems = []
    if list(meta.parameters) != list(schema.parameters):
        problems.append(f"{op}: parameters differ: meta {list(meta.parameters)} vs schema {list(schema.parameters)}")
    for name, p in schema.parameters.items():
        m = meta.parameters.get(name)
        if m is not None and m.default != p.default:
            problems.append(f"{op}: default of {name}: meta {m.default!r} vs schema {p.default!r}")
    return problems


def fused_ops(scan: ProjectScan, release: Release) -> list[str]:
    """The custom ops (torch.ops.npu, with a schema) among the project's calls."""
    ops = set()
    for use in scan.calls:
        definition = release.resolve(use.target)
        if definition is not None and definition.kind == "op":
            ops.add(use.target.split(".", 1)[1])
    return sorted(ops)


# ------------------------------------------------------------------------------------------------
# Command line (CI's fetch step, and a readable report)


def _main(argv: Sequence[str]) -> int:
    command = argv[0] if argv else "report"
    if command not in ("fetch", "report", "write-record"):
        print(f"usage: python tests/npu_contract.py [fetch|report|write-record] (got {command!r})", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    try:
        wheel = release_wheel()
    except ContractError as exc:
        print(f"NPU contract: {exc}", file=sys.stderr)
        return 1
    if command == "fetch":
        print(wheel)
        return 0
    release = Release(wheel)
    scan = scan_project()
    checks = [check_use(use, release) for use in scan.uses]
    if command == "write-record":
        RECORD_PATH.write_text(json.dumps(record(checks, release.version), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RECORD_PATH}")
        return 0
    print(f"torch_npu {release.version} ({wheel})")
    for check in checks:
        print(f"  {check.use.where:32} {check.use.describe():60} {'; '.join(check.problems) or 'ok'}")
        if check.relied_defaults:
            print(f"  {'':32}   relies on " + ", ".join(f"{k}={v!r}" for k, v in check.relied_defaults.items()))
    protocol = backend_protocol()
    for fake in find_fakes(sources_of_tests(), scan.injections, protocol):
        result = check_fake(fake, release, protocol)
        print(f"  fake {fake.label} -> {fake.target}: {'; '.join(result.problems) or 'ok'}")
    for op in fused_ops(scan, release):
        try:
            meta_callable(release, op)
            stubbed = [
                f"{name} ({why})"
                for name, (_, why) in META_STUBS.items()
                if name in _free_names(release.meta_function(op))
            ]
            print(f"  meta {op}: runs on plain torch" + (f"; stubbed: {'; '.join(stubbed)}" if stubbed else ""))
        except MetaUnavailable as exc:
            print(f"  meta {op}: cannot run: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
