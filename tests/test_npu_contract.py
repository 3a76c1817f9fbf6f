"""The NPU contract (tests/npu_contract.py): our torch_npu calls and NPU fakes against the real release.

The release tests need the pinned torch_npu wheel (fetched once into the cache folder, never installed).
If it cannot be fetched they FAIL with pip's reason instead of skipping: they are the only NPU truth CI
has. The checker itself is also tested on synthetic releases and snippets (no network), so that every
check is shown to fail on the mistake it exists for.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace

import npu_contract as contract
import pytest

from hidream_ui.cli import doctor

# Fakes in test files this change was not allowed to edit that break `compare_fake`'s rule, with the fix.
# The fakes test fails when a fake not listed here breaks the rule, AND when a listed one is fixed (then
# delete its entry), so this list can only shrink. Each listed one is reported as a warning on every run.
KNOWN_FAKE_VIOLATIONS: dict = {}  # (fake, real name) -> the fix; empty: every fake follows the release


# ------------------------------------------------------------------------------------------------
# The real release (session fixtures)


@pytest.fixture(scope="session")
def release() -> contract.Release:
    """The pinned torch_npu release; fails (never skips) every test using it when it cannot be fetched."""
    try:
        return contract.Release(contract.release_wheel())
    except contract.ContractError as exc:
        pytest.fail(
            f"NPU contract: the torch_npu release cannot be read, so nothing NPU is verified: {exc}", pytrace=False
        )


@pytest.fixture(scope="session")
def project() -> contract.ProjectScan:
    return contract.scan_project()


@pytest.fixture(scope="session")
def checks(project, release) -> list[contract.CallCheck]:
    return [contract.check_use(use, release) for use in project.uses]


def test_torch_npu_pin_is_the_twin_of_the_torch_pin_and_of_doctor():
    pins = contract.pinned_versions()
    import torch

    assert pins["torch_npu"].split(".post")[0] == pins["torch"], (
        f"requirements_npu.txt pins torch=={pins['torch']} with torch_npu=={pins['torch_npu']}: torch_npu "
        "releases are built for one torch release; move them together"
    )
    installed = torch.__version__.split("+")[0]
    assert pins["torch"] == installed, (
        f"requirements_npu.txt pins torch=={pins['torch']} but tests run on torch {installed}: move the "
        "torch/torch_npu pair in requirements_npu.txt (and the contract with it) to the torch CI tests"
    )
    assert doctor.NPU_CONTRACT_TORCH_NPU == pins["torch_npu"], (
        f"hidream_ui/cli/doctor.py says the contract was checked against torch_npu {doctor.NPU_CONTRACT_TORCH_NPU} "
        f"but requirements_npu.txt pins torch_npu=={pins['torch_npu']}"
    )


def test_the_wheel_read_is_the_pinned_release(release):
    assert release.version == contract.pinned_versions()["torch_npu"], (
        f"{release.wheel} is torch_npu {release.version}, not the pinned release"
    )


@pytest.mark.slow
def test_uses_are_derived_from_the_project_code(project):
    """Guards the derivation itself: if the scanner stopped seeing our calls, the contract would be empty."""
    calls = project.calls
    fusion = [c for c in calls if c.target == "torch_npu.npu_fusion_attention"]
    assert fusion and all(c.context == "NpuFusionProcessor.attend" for c in fusion)
    npu_backend = {c.target for c in calls if c.context.startswith("NPUBackend.")}
    # The shared _TorchAcceleratorBackend body is analysed as NPUBackend (whose _module is torch_npu.npu):
    assert len(npu_backend) >= 10 and all(t.startswith("torch_npu.npu.") for t in npu_backend)
    assert not [c for c in calls if c.context.startswith("CUDABackend.")], "torch.cuda is not torch_npu"
    assert {(i.owner, i.parameter, i.kind, i.target) for i in project.injections} >= {
        ("NPUBackend", "import_module", "returns", "torch_npu"),
        ("NpuFusionProcessor", "fusion_fn", "is", "torch_npu.npu_fusion_attention"),
    }


def test_every_torch_npu_name_we_use_exists_and_every_call_binds(checks):
    problems = [p for check in checks for p in check.problems]
    assert not problems, "the real torch_npu disagrees with our calls:\n" + "\n".join(problems)


def test_readme_names_the_checked_release_and_every_name_we_use(project):
    text = (contract.ROOT / "docs" / "npu.md").read_text(encoding="utf-8")
    section = text[text.index("## What the NPU code was checked against") : text.index("## Never run on hardware")]
    assert f"torch_npu {contract.pinned_versions()['torch_npu']}" in section
    missing = sorted({c.target for c in project.calls if f"`{c.target.rsplit('.', 1)[1]}`" not in section})
    assert not missing, f"docs/npu.md does not list these torch_npu names the code now uses: {missing}"


def test_recorded_defaults_are_the_release_defaults(checks, release):
    """The record (tests/npu_contract_record.json) is what each call passes and the real defaults it
    relies on. A changed record means a call or a real default changed: review, then rewrite it."""
    current = contract.record(checks, release.version)
    saved = json.loads(contract.RECORD_PATH.read_text(encoding="utf-8"))
    if current != saved:
        changed = sorted(set(current["calls"]) ^ set(saved["calls"])) + sorted(
            k for k in set(current["calls"]) & set(saved["calls"]) if current["calls"][k] != saved["calls"][k]
        )
        pytest.fail(
            f"NPU calls or the defaults they rely on changed (torch_npu {saved['torch_npu']} -> "
            f"{current['torch_npu']}): {changed}. Review, then run `python tests/npu_contract.py "
            "write-record`",
            pytrace=False,
        )


def test_npu_fusion_attention_defaults_our_processor_relies_on(checks):
    """NpuFusionProcessor computes plain softmax(q k^T / sqrt(d) + bias) v; these real defaults make it so."""
    [check] = [c for c in checks if c.use.call and c.use.target == "torch_npu.npu_fusion_attention"]
    signature = check.definition.signature.parameters
    # The kernel's default scale is 1.0, not 1/sqrt(d): the call must pass it.
    assert signature["scale"].default == 1.0 and "scale" in check.passed
    # input_layout has no default: passed (5th, by position) as "BSND" / "BNSD".
    assert signature["input_layout"].default is inspect.Parameter.empty
    assert check.passed[:5] == ("query", "key", "value", "head_num", "input_layout")
    assert "pse" in check.passed and "keep_prob" in check.passed
    # No mask, no padding, no sparsity band, no dropout mask: full attention over every key.
    assert check.relied_defaults["atten_mask"] is None and check.relied_defaults["padding_mask"] is None
    assert check.relied_defaults["pre_tockens"] == check.relied_defaults["next_tockens"] == 2147483647
    assert check.relied_defaults["sparse_mode"] == 0 and check.relied_defaults["dropout_mask"] is None


# Ops whose release meta function names its parameters differently from the op schema, in the same order
# with the same defaults. The dispatcher binds a call by the schema and hands the meta function positional
# arguments, so only keyword calls could tell: we call these ops with positional arguments only.
META_NAMES_DIFFER = {"npu_rotary_mul": ["embedding", "cosine", "sine", "mode", "rotate"]}


@pytest.mark.slow
def test_meta_function_agrees_with_the_op_schema(release, project):
    for op in contract.fused_ops(project, release):
        problems = contract.meta_matches_schema(release, op)
        if op in META_NAMES_DIFFER:
            names = list(contract.signature_from_ast(release.meta_function(op).args).parameters)
            assert names == META_NAMES_DIFFER[op] and len(problems) == 1 and "parameters differ" in problems[0]
            assert all(not c.keywords for c in project.calls if c.target == f"torch_npu.{op}"), (
                f"{op} must be called with positional arguments only: its meta and schema names differ"
            )
        else:
            assert problems == []


@pytest.mark.slow
def test_fakes_accept_nothing_the_real_functions_refuse(release, project):
    protocol = contract.backend_protocol()
    fakes = contract.find_fakes(contract.sources_of_tests(), project.injections, protocol)
    targets = {fake.target for fake in fakes}
    # The discovery found the three kinds of fake (guards against checking nothing):
    assert "torch_npu.npu_fusion_attention" in targets and "torch_npu.npu" in targets
    assert "torch_npu.npu.mem_get_info" in targets and "hidream_ui.device.backends.NPUBackend.mem_get_info" in targets
    violations = {}
    for fake in fakes:
        result = contract.check_fake(fake, release, protocol)
        if result.problems:
            violations[(fake.label, fake.target)] = result.problems
    new = {k: v for k, v in violations.items() if k not in KNOWN_FAKE_VIOLATIONS}
    fixed = sorted(set(KNOWN_FAKE_VIOLATIONS) - set(violations))
    assert not new, "fakes accept calls the real torch_npu refuses:\n" + "\n".join(p for v in new.values() for p in v)
    assert not fixed, f"these fakes now follow the real signatures: delete them from KNOWN_FAKE_VIOLATIONS: {fixed}"
    for key, fix in KNOWN_FAKE_VIOLATIONS.items():  # a violation listed while its fix is pending
        warnings.warn(f"NPU contract: {'; '.join(violations[key])}. Fix: {fix}", stacklevel=1)


def _mutated(path: str, target: str, change) -> str:
    """``path``'s source with ``change`` applied (in the ast) to its first call of ``target``."""
    import ast

    source = (contract.ROOT / path).read_text(encoding="utf-8")
    use = next(u for u in contract.scan_source(source, path).calls if u.target == target)
    line, name = int(use.where.rsplit(":", 1)[1]), target.rsplit(".", 1)[1]
    tree = ast.parse(source)
    candidates = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and n.lineno == line
        and len(n.args) == use.positional
        and tuple(k.arg for k in n.keywords) == use.keywords
    ]
    # The call itself, not a helper call on the same line (``self._module()`` in ``self._module().x(i)``):
    [call] = [
        n
        for n in candidates
        if isinstance(n.func, ast.Call) or (isinstance(n.func, ast.Attribute) and n.func.attr == name)
    ]
    change(call)
    return ast.unparse(tree)


def _add_keyword(name):
    import ast

    return lambda call: call.keywords.append(ast.keyword(name, ast.Constant(1.0)))


def _drop_last_positional(call):
    call.args.pop()


def _positional_to_keyword(name):
    import ast

    return lambda call: call.keywords.append(ast.keyword(name, call.args.pop(0)))


@pytest.mark.parametrize(
    "path, target, change, expected",
    [
        (
            "hidream_ui/pipeline/attention/npu.py",
            "torch_npu.npu_fusion_attention",
            _add_keyword("scale_value"),
            "unexpected keyword argument 'scale_value'",
        ),
        (
            "hidream_ui/pipeline/attention/npu.py",
            "torch_npu.npu_fusion_attention",
            _drop_last_positional,
            "missing a required argument: 'input_layout'",
        ),
        (
            "hidream_ui/device/backends.py",
            "torch_npu.npu.mem_get_info",
            _positional_to_keyword("index"),
            "unexpected keyword argument 'index'",
        ),
        (
            "hidream_ui/device/backends.py",
            "torch_npu.npu.set_device",
            _add_keyword("index"),
            "unexpected keyword argument 'index'",
        ),
    ],
)
def test_the_contract_fails_on_a_broken_copy_of_our_own_calls(release, path, target, change, expected):
    """Our real call sites, broken in memory (the files are not touched): the contract must refuse them."""
    scan = contract.scan_source(_mutated(path, target, change), path)
    problems = [p for use in scan.uses for p in contract.check_use(use, release).problems]
    assert any(expected in p for p in problems), problems


# -- meta (shape) functions of the fused ops we call ---------------------------------------------


def _fusion_cases():
    from hidream_ui.bench import attention as bench

    for profile_name in ("bench", "tiny"):
        profile = bench.PROFILES[profile_name]
        for side in profile.sides:
            shape = bench.edit_shape(profile, side)
            for layout in ("BSND", "BNSD"):
                for pse_layout in ("BN1S", "BNSS"):
                    for biased in (True, False):
                        yield pytest.param(
                            shape,
                            layout,
                            pse_layout,
                            biased,
                            id=f"{profile_name}-{shape.label}-{layout}-{pse_layout}-{'bias' if biased else 'nobias'}",
                        )


@pytest.mark.slow
@pytest.mark.parametrize("shape, layout, pse_layout, biased", list(_fusion_cases()))
def test_npu_fusion_attention_meta_gives_the_shapes_our_processor_expects(release, shape, layout, pse_layout, biased):
    """The release's own shape rule, run on meta tensors through NpuFusionProcessor.attend at HiDream's
    real attention shapes (bench_attention's profiles: batch 3, 20 heads x 128, collapsed padding)."""
    import torch

    from hidream_ui.pipeline.attention.npu import NpuFusionProcessor

    meta = contract.meta_callable(release, "npu_fusion_attention")
    seen = {}

    def recording(*args, **kwargs):
        result = meta(*args, **kwargs)
        seen.update(args=args, kwargs=kwargs, result=result)
        return result

    b, s, n, d = shape.batch, shape.seq, shape.heads, shape.head_dim
    q, k, v = (torch.empty(b, s, n, d, device="meta", dtype=torch.bfloat16) for _ in range(3))
    bias = torch.empty(b, s, device="meta", dtype=torch.float32) if biased else None
    out = NpuFusionProcessor(fusion_fn=recording, input_layout=layout, pse_layout=pse_layout).attend(q, k, v, bias)

    assert out.shape == (b, s, n, d) and out.dtype == torch.bfloat16  # what HiDreamStrategyProcessor reshapes
    score, softmax_max, softmax_sum = seen["result"][:3]
    assert tuple(score.shape) == ((b, s, n, d) if layout == "BSND" else (b, n, s, d))
    assert tuple(softmax_max.shape) == tuple(softmax_sum.shape) == (b, n, s, 8)
    pse = seen["kwargs"]["pse"]
    assert (pse is None) == (not biased)
    if biased:
        assert tuple(pse.shape) == (b, n, 1 if pse_layout == "BN1S" else s, s) and pse.dtype == torch.bfloat16
    assert seen["kwargs"]["scale"] == pytest.approx(1 / math.sqrt(d))


def test_every_fused_op_we_call_has_its_meta_run(release, project):
    """The fused ops we call, each with a shape test (above and below) on its release meta function
    (or, when its meta function cannot run, a test that says why: see test_meta_that_needs_torch_npu...)."""
    assert contract.fused_ops(project, release) == ["npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul"]
    contract.meta_callable(release, "npu_fusion_attention")  # runs on plain torch (a stubbed warning only)


@pytest.mark.slow
@pytest.mark.parametrize("seq", [4096 + 128 * 3 + 1, 1024])
def test_rms_norm_and_rotary_mul_meta_give_the_shapes_our_processor_expects(release, seq):
    """npu_rms_norm / npu_rotary_mul through NpuFusionProcessor's q/k norm and rope on meta tensors at
    HiDream's real shapes (batch 3, 20 heads x 128, rope on the full head)."""
    import torch

    from hidream_ui.pipeline.attention.npu import NpuFusionProcessor

    metas = {op: contract.meta_callable(release, op) for op in ("npu_rms_norm", "npu_rotary_mul")}
    seen = {}

    def recorder(op):
        def call(*args, **kwargs):
            seen[op] = (args, kwargs)
            return metas[op](*args, **kwargs)

        return call

    processor = NpuFusionProcessor(rms_norm_fn=recorder("npu_rms_norm"), rotary_mul_fn=recorder("npu_rotary_mul"))
    norm = torch.nn.RMSNorm(2560, eps=1e-5, device="meta", dtype=torch.bfloat16)
    x = torch.empty(3, seq, 2560, device="meta", dtype=torch.bfloat16)
    y = processor._rms_norm(norm, x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert seen["npu_rms_norm"][1] == {"epsilon": 1e-5}
    q = torch.empty(3, seq, 20, 128, device="meta", dtype=torch.bfloat16)
    freqs = torch.empty(3, seq, 1, 64, 2, 2, device="meta", dtype=torch.float32)
    out = processor._rotary(q, freqs)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    args, kwargs = seen["npu_rotary_mul"]
    assert [tuple(a.shape) for a in args[:3]] == [(3, seq, 20, 128), (3, seq, 1, 128), (3, seq, 1, 128)]
    assert args[3] == "interleave" and not kwargs


# ------------------------------------------------------------------------------------------------
# The checker on synthetic releases and snippets (no network): each check fails when it must

SYNTHETIC = {
    "torch_npu/version.py": "__version__ = '9.9.9'\n",
    "torch_npu/__init__.py": "import os\nimport torch\n",
    "torch_npu/npu/__init__.py": (
        "import torch_npu\n"
        "from .utils import set_device, mem_get_info as mem_get_info\n"
        "from .memory import *\n"
        "def get_device_name(device_name=None):\n    return 'x'\n"
        "config = object()\n"
        "try:\n    def is_available():\n        return True\nexcept ImportError:\n    pass\n"
    ),
    "torch_npu/npu/utils.py": "def set_device(device):\n    pass\ndef mem_get_info(device=None):\n    return 0, 0\n",
    "torch_npu/npu/memory.py": (
        "__all__ = ['memory_stats']\n"
        "def memory_stats(device=None):\n    return {}\n"
        "def not_exported(device=None):\n    return {}\n"
    ),
    "torch_npu/dynamo/__init__.py": "",
    "torch_npu/dynamo/torchair/__init__.py": (
        "from torchair.npu_fx_compiler import get_npu_backend\n"
        "from torchair.configs.compiler_config import CompilerConfig\n"
    ),
    "torch_npu/dynamo/torchair/npu_fx_compiler.py": (
        "def get_npu_backend(*, compiler_config=None, custom_decompositions={}):\n    pass\n"
    ),
    "torch_npu/dynamo/torchair/configs/__init__.py": "",
    "torch_npu/dynamo/torchair/configs/compiler_config.py": (
        "from .base import NpuBaseConfig\nclass CompilerConfig(NpuBaseConfig):\n    pass\n"
    ),
    "torch_npu/dynamo/torchair/configs/base.py": (
        "class NpuBaseConfig:\n    def __init__(self, strict=True):\n        pass\n"
    ),
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml": (
        "custom:\n"
        "- func: npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        'int pre_tockens=2147483647, str softmax_layout="") -> (Tensor, Tensor, Tensor, Tensor, int, int, int)\n'
        "- func: npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)\n"
        "- func: npu_needs_c(Tensor x, *, int mode=0) -> Tensor\n"
    ),
    "torch_npu/op_plugin/meta/_meta_registrations.py": (
        "@impl(m, 'npu_fusion_attention')\n"
        "def npu_fusion_attention_forward(query, key, value, head_num, input_layout, pse=None, atten_mask=None,\n"
        "                                 scale=1.0, keep_prob=1.0, pre_tockens=2147483647, softmax_layout=''):\n"
        "    _warn_npu_fusion_attention_compile_once()\n"
        "    return (torch.empty_like(query), None, None, None, 0, 0, 0)\n"
        "@impl(m, 'npu_rms_norm')\n"
        "def npu_rms_norm_meta(self, gamma, epsilon=1e-5):\n"
        "    return torch.empty_like(self), torch.empty_like(self)\n"
        "@impl(m, 'npu_needs_c')\n"
        "def npu_needs_c_meta(x, *, mode=0):\n"
        "    if get_soc_version() >= 260:\n"
        "        return x.new_empty([1])\n"
        "    return torch.empty_like(x)\n"
    ),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> contract.Release:
    path = tmp_path_factory.mktemp("wheel") / "torch_npu-9.9.9-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in SYNTHETIC.items():
            wheel.writestr(name, text)
    return contract.Release(path)


def problems_of(source: str, release: contract.Release) -> list[str]:
    scan = contract.scan_source(source, "snippet.py")
    assert scan.uses, "the scanner found no torch_npu use in the snippet"
    return [p for use in scan.uses for p in contract.check_use(use, release).problems]


def test_release_resolves_through_imports_star_exports_and_torchair(synthetic):
    assert synthetic.version == "9.9.9"
    assert synthetic.resolve("torch_npu.npu").kind == "module"
    assert str(synthetic.resolve("torch_npu.npu.set_device").signature) == "(device)"
    assert str(synthetic.resolve("torch_npu.npu.mem_get_info").signature) == "(device=None)"
    assert synthetic.resolve("torch_npu.npu.memory_stats").file == "torch_npu/npu/memory.py"
    assert synthetic.resolve("torch_npu.npu.not_exported") is None  # not in memory.py's __all__
    assert synthetic.resolve("torch_npu.npu.is_available").kind == "function"  # defined inside try:
    assert synthetic.resolve("torch_npu.npu.config").kind == "value"
    assert synthetic.resolve("torch_npu.npu_fusion_attention").kind == "op"
    assert synthetic.resolve("torch_npu.npu_fusion_attentions") is None
    backend = synthetic.resolve("torch_npu.dynamo.torchair.get_npu_backend")
    assert str(backend.signature) == "(*, compiler_config=None, custom_decompositions={})"
    assert str(synthetic.resolve("torch_npu.dynamo.torchair.CompilerConfig").signature) == "(strict=True)"


def test_schema_signature_keeps_keyword_only_arguments_and_defaults():
    signature = contract.signature_from_schema(
        'f(Tensor a, int b=2147483647, *, float scale=1., str layout="BSND", int[]? p=None, bool s=False) -> Tensor'
    )
    assert str(signature) == "(a, b=2147483647, *, scale=1.0, layout='BSND', p=None, s=False)"


def test_correct_calls_pass_and_record_the_defaults_they_rely_on(synthetic):
    source = (
        "import torch_npu\n"
        "def attend(q, k, v):\n"
        "    return torch_npu.npu_fusion_attention(q, k, v, 8, 'BSND', pse=None, scale=0.125)\n"
    )
    [use] = [u for u in contract.scan_source(source).uses if u.call]
    check = contract.check_use(use, synthetic)
    assert check.problems == ()
    assert check.passed == ("query", "key", "value", "head_num", "input_layout", "pse", "scale")
    assert check.relied_defaults == {
        "atten_mask": None,
        "keep_prob": 1.0,
        "pre_tockens": 2147483647,
        "softmax_layout": "",
    }


@pytest.mark.parametrize(
    "call, expected",
    [
        (
            "torch_npu.npu_fusion_attention(q, k, v, 8, 'BSND', scale_value=0.1)",
            "unexpected keyword argument 'scale_value'",
        ),
        ("torch_npu.npu_fusion_attention(q, k, v, input_layout='BSND')", "missing a required argument: 'head_num'"),
        (
            "torch_npu.npu_fusion_attention(q, k, v, 8, 'BSND', input_layout='BNSD')",
            "multiple values for argument 'input_layout'",
        ),
        ("torch_npu.npu_fusion_attention(q, k, v, 8, 'BSND', None, None, 1.0, 1.0, 1, '', 0)", "too many positional"),
        ("torch_npu.npu_fusion_attention(q, k, v, 8, 'BSND', **options)", "cannot be checked"),
        ("torch_npu.npu_fusion_attenton(q, k, v, 8, 'BSND')", "has no torch_npu.npu_fusion_attenton"),
        ("torch.npu.set_device(index=0)", "unexpected keyword argument 'index'"),
        ("torch.npu.mem_get_info(0, 1)", "too many positional"),
        ("torch.npu.not_exported(0)", "has no torch_npu.npu.not_exported"),
        ("torch.npu.config()", "signature its sources do not give"),
        ("torchair.get_npu_backend(torchair.CompilerConfig())", "too many positional"),
        ("torchair.CompilerConfig(strict=True, verbose=True)", "unexpected keyword argument 'verbose'"),
    ],
)
def test_wrong_calls_fail_with_the_reason(synthetic, call, expected):
    source = f"import torch\nimport torch_npu\nimport torchair\ndef run(q, k, v, options):\n    return {call}\n"
    problems = problems_of(source, synthetic)
    assert any(expected in p for p in problems), problems
    assert all("snippet.py:5" in p for p in problems)


def test_right_torch_npu_and_torchair_calls_pass(synthetic):
    source = (
        "import torch\nimport torchair as tng\nfrom torch_npu.npu import memory_stats\n"
        "def run():\n"
        "    torch.npu.set_device(device=1)\n"
        "    memory_stats(0)\n"
        "    return tng.get_npu_backend(compiler_config=tng.CompilerConfig())\n"
    )
    assert problems_of(source, synthetic) == []


def test_calls_are_derived_through_injected_importers_and_methods(synthetic):
    """The NPUBackend / NpuFusionProcessor patterns: the module comes from an injected importer and a
    method; the op from a method that returns either the injected fake or the real one."""
    source = """
import importlib, sys

class Base:
    def _module(self):
        raise NotImplementedError
    def name(self, index):
        return self._module().get_device_name(index=index)

class NPU(Base):
    def __init__(self, import_module=None):
        self._import = import_module or importlib.import_module
    def _module(self):
        torch_npu = self._import("torch_npu")
        return torch_npu.npu

class Other(Base):
    def _module(self):
        import torch
        return torch.cuda

class Fusion:
    def __init__(self, fusion_fn=None):
        self.fusion_fn = fusion_fn
    def _function(self):
        if self.fusion_fn is not None:
            return self.fusion_fn
        import torch_npu
        return torch_npu.npu_fusion_attention
    def attend(self, q):
        return self._function()(q, q, q, 8, "BSND", scale_value=1.0)

def available():
    module = sys.modules.get("torch_npu")
    return hasattr(module, "npu_fusion_attentionX") and getattr(module, "npu").is_available()

def _npu():
    import torch_npu as tn
    return tn.npu

def helper_and_closure():
    npu = _npu()
    def inner():
        return npu.mem_get_info(device=0)
    return inner
"""
    scan = contract.scan_source(source, "snippet.py")
    calls = {(u.context, u.target, u.keywords) for u in scan.calls}
    assert calls == {
        ("NPU.name", "torch_npu.npu.get_device_name", ("index",)),
        ("Fusion.attend", "torch_npu.npu_fusion_attention", ("scale_value",)),
        ("available", "torch_npu.npu.is_available", ()),
        ("helper_and_closure.inner", "torch_npu.npu.mem_get_info", ("device",)),
    }
    assert {(i.owner, i.parameter, i.kind, i.target) for i in scan.injections} == {
        ("NPU", "import_module", "returns", "torch_npu"),
        ("Fusion", "fusion_fn", "is", "torch_npu.npu_fusion_attention"),
    }
    problems = [p for use in scan.uses for p in contract.check_use(use, synthetic).problems]
    assert len(problems) == 3, problems
    assert any("'index'" in p for p in problems) and any("'scale_value'" in p for p in problems)
    assert any("has no torch_npu.npu_fusion_attentionX" in p for p in problems)


# -- the fake rule --------------------------------------------------------------------------------


def sig(text: str) -> inspect.Signature:
    import ast

    return contract.signature_from_ast(ast.parse(f"def f{text}: pass").body[0].args)


@pytest.mark.parametrize(
    "fake, real, expected",
    [
        ("(index)", "(device=None)", "unexpected keyword argument 'index'"),  # a keyword the real one lacks
        ("(q, *, scale=1.0, **unused)", "(q, *, scale=1.0)", "<any other keyword>"),  # **kwargs the real one lacks
        ("(q, layout='BSND')", "(q, layout)", "missing a required argument: 'layout'"),  # optional what is required
        ("(q, *args)", "(q)", "too many positional"),  # *args the real one lacks
        ("(q, k, v)", "(q, k)", "too many positional"),
        ("(k, q)", "(q, k)", "multiple values"),  # same names, other order
        ("(q, scale=0.5)", "(q, scale=1.0)", "default scale=0.5 differs from the real scale=1.0"),
        ("(q, flag=1)", "(q, flag=True)", "default flag=1 differs"),
    ],
)
def test_a_fake_more_lenient_than_the_real_function_is_refused(fake, real, expected):
    problems = contract.compare_fake(sig(fake), sig(real))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "fake, real",
    [
        ("(device=None)", "(device=None)"),
        ("(index, /)", "(device=None)"),  # stricter: positional only
        ("(q, k, *, scale=1.0)", "(q, k, scale=1.0, keep_prob=1.0)"),  # stricter: keyword-only, fewer options
        ("(q, keep_prob=1)", "(q, keep_prob=1.0)"),  # 1 == 1.0 as a default
        ("()", "(including_emulation=False)"),
        ("(q, **kwargs)", "(q, **kwargs)"),
    ],
)
def test_a_fake_as_strict_or_stricter_than_the_real_function_passes(fake, real):
    assert contract.compare_fake(sig(fake), sig(real)) == []


def test_fakes_are_found_by_how_tests_inject_them_and_checked(synthetic):
    """Wrong fakes in synthetic test files: found through the project's injection points, refused."""
    injections = [
        contract.Injection("NPUBackend", "import_module", "returns", "torch_npu"),
        contract.Injection("NpuFusionProcessor", "fusion_fn", "is", "torch_npu.npu_fusion_attention"),
    ]
    sources = {
        "tests/fakes_x.py": (
            "class ModuleFake:\n    def __init__(self, npu):\n        self.npu = npu\n"
            "class Backend:\n    type = 'npu'\n    def mem_get_info(self, index, extra=None):\n        return 0, 0\n"
        ),
        "tests/test_x.py": (
            "from fakes_x import ModuleFake, Backend\n"
            "class Sub(Backend):\n    pass\n"
            "class Fusion:\n    def __call__(self, query, key, value, head_num, input_layout, *, scale=0.5, **rest):\n"
            "        return query\n"
            "def test_a():\n"
            "    class NPU:\n        def mem_get_info(self, index):\n            return 0, 0\n"
            "        def missing_in_release(self):\n            return 1\n"
            "    backend = NPUBackend(import_module=lambda name: ModuleFake(NPU()))\n"
            "def test_b():\n"
            "    fake = Fusion()\n"
            "    run(fusion_fn=fake)\n"
            "    options = {'fusion_fn': lambda query, key, value, head_num, input_layout, pse=None: query}\n"
        ),
    }
    protocol = {"mem_get_info": sig("(index)")}
    fakes = contract.find_fakes(sources, injections, protocol)
    found = {(f.label, f.target) for f in fakes}
    assert found == {
        ("tests/fakes_x.py::ModuleFake.npu", "torch_npu.npu"),
        ("tests/test_x.py::NPU.mem_get_info", "torch_npu.npu.mem_get_info"),
        ("tests/test_x.py::NPU.missing_in_release", "torch_npu.npu.missing_in_release"),
        ("tests/test_x.py::Fusion.__call__", "torch_npu.npu_fusion_attention"),
        ("tests/test_x.py:17::<lambda>", "torch_npu.npu_fusion_attention"),
        ("tests/fakes_x.py::Backend.mem_get_info", "hidream_ui.device.backends.NPUBackend.mem_get_info"),
        ("tests/test_x.py::Sub.mem_get_info", "hidream_ui.device.backends.NPUBackend.mem_get_info"),
    }
    problems = {f.label: contract.check_fake(f, synthetic, protocol).problems for f in fakes}
    assert problems["tests/fakes_x.py::ModuleFake.npu"] == ()
    assert problems["tests/test_x.py:17::<lambda>"] == ()  # the real op's names, positional-or-keyword too
    assert "unexpected keyword argument 'index'" in problems["tests/test_x.py::NPU.mem_get_info"][0]
    assert "does not have" in problems["tests/test_x.py::NPU.missing_in_release"][0]
    fusion = " ".join(problems["tests/test_x.py::Fusion.__call__"])
    assert "<any other keyword>" in fusion and "default scale=0.5" in fusion
    sub = " ".join(problems["tests/test_x.py::Sub.mem_get_info"])  # inherits mem_get_info(index, extra=None)
    assert "unexpected keyword argument 'extra'" in sub and "too many positional" in sub


# -- meta functions -------------------------------------------------------------------------------


def test_meta_functions_run_with_stubbed_helpers_only(synthetic):
    import torch

    fusion = contract.meta_callable(synthetic, "npu_fusion_attention")  # needs only the stubbed warning
    q = torch.empty(2, 7, 3, 16, device="meta", dtype=torch.float16)
    assert fusion(q, q, q, 3, "BSND", scale=0.25)[0].shape == q.shape
    assert contract.meta_callable(synthetic, "npu_rms_norm")(q, q)[0].shape == q.shape


def test_meta_that_needs_torch_npu_is_reported_not_guessed(synthetic):
    with pytest.raises(contract.MetaUnavailable, match="needs get_soc_version from torch_npu"):
        contract.meta_callable(synthetic, "npu_needs_c")
    with pytest.raises(contract.MetaUnavailable, match="no meta function for npu_nothing"):
        contract.meta_callable(synthetic, "npu_nothing")


def test_meta_and_schema_disagreement_is_found(synthetic):
    assert contract.meta_matches_schema(synthetic, "npu_fusion_attention") == []
    assert contract.meta_matches_schema(synthetic, "npu_rms_norm") == [
        "npu_rms_norm: default of epsilon: meta 1e-05 vs schema 1e-06"
    ]


# -- fetching the wheel ---------------------------------------------------------------------------


def test_pins_are_read_from_requirements_npu(tmp_path):
    good = tmp_path / "req.txt"
    good.write_text("# comment\ntorch==2.13.0\ntorch-npu==2.13.0.post1  # twin\nother==1\n")
    assert contract.pinned_versions(good) == {"torch": "2.13.0", "torch_npu": "2.13.0.post1"}
    bad = tmp_path / "bad.txt"
    bad.write_text("torch==2.13.0\n")
    with pytest.raises(contract.ContractError, match="no 'torch_npu==<version>' line"):
        contract.pinned_versions(bad)


def test_fetch_failure_is_an_error_with_pips_reason(tmp_path):
    calls = []

    def failing(command, **kwargs):
        calls.append(command)
        return SimpleNamespace(
            returncode=1, stdout="", stderr="ERROR: No matching distribution found for torch_npu==0.0.1"
        )

    with pytest.raises(contract.ContractError, match="No matching distribution found") as info:
        contract.fetch_wheel("0.0.1", tmp_path / "wheels", runner=failing)
    assert "torch_npu==0.0.1" in str(info.value)
    assert "--no-deps" in calls[0] and "download" in calls[0]
    assert not list((tmp_path / "wheels").glob("*.whl"))  # nothing half-downloaded left to trust


def test_fetch_downloads_once_then_reuses_the_cached_wheel(tmp_path):
    calls = []

    def downloading(command, **kwargs):
        calls.append(command)
        target = Path(command[command.index("-d") + 1]) / "torch_npu-1.2.3-cp311-cp311-manylinux_2_28_x86_64.whl"
        target.write_bytes(b"wheel")
        return subprocess.CompletedProcess(command, 0, "", "")

    first = contract.fetch_wheel("1.2.3", tmp_path, runner=downloading)
    second = contract.fetch_wheel("1.2.3", tmp_path, runner=downloading)
    assert first == second == tmp_path / "torch_npu-1.2.3-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert len(calls) == 1 and first.read_bytes() == b"wheel"


def test_a_given_wheel_that_is_missing_or_not_torch_npu_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(contract.ContractError, match="is not a file"):
        contract.release_wheel()
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as wheel:
        wheel.writestr("other/__init__.py", "")
    with pytest.raises(contract.ContractError, match="not a torch_npu wheel"):
        contract.Release(other)


# ------------------------------------------------------------------------------------------------
# doctor: the installed torch_npu against the checked release


@pytest.mark.parametrize(
    "installed, warns",
    [(None, False), ("2.13.0", False), ("2.13.0+gitc798c65", False), ("2.14.0", True), ("2.13.0.post1", True)],
)
def test_doctor_warns_when_torch_npu_is_not_the_checked_release(installed, warns):
    asked = []

    def version_of(name):
        asked.append(name)
        return installed

    result = doctor.torch_npu_check(version_of=version_of)
    assert asked == ["torch_npu"]
    assert result["installed"] == installed and result["checked_against"] == doctor.NPU_CONTRACT_TORCH_NPU
    assert (result["warning"] is not None) == warns
    if warns:
        assert installed in result["warning"] and doctor.NPU_CONTRACT_TORCH_NPU in result["warning"]


def test_doctor_prints_the_torch_npu_version_and_the_warning(tiny_cache, monkeypatch, capsys):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda name: "2.14.0" if name == "torch_npu" else real(name))
    assert doctor.main(["--device", "cpu"]) == 0  # a warning, not a problem
    out = capsys.readouterr().out
    assert f"torch_npu: 2.14.0 (NPU calls checked against torch_npu {doctor.NPU_CONTRACT_TORCH_NPU})" in out
    assert "WARNING: torch_npu 2.14.0 is installed but" in out
    assert doctor.main(["--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch_npu"]["installed"] == "2.14.0" and report["warnings"] == [report["torch_npu"]["warning"]]


def test_doctor_without_torch_npu_says_nothing_about_it(tiny_cache, monkeypatch, capsys):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda name: None if name == "torch_npu" else real(name))
    assert doctor.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch_npu:" not in out and "WARNING" not in out
