"""`python -m hidream_ui doctor [--json]`: what this machine has and whether the model can load.

Replaces the `test_npu_setup.py` of the NPU migration notes. Exit code 0 when the configured
model's files are all there and a device was found; 1 otherwise (the report says why).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys

from hidream_ui import __version__
from hidream_ui.config import ConfigError, add_model_arguments, from_namespace
from hidream_ui.device import backends as device_backends
from hidream_ui.device import detect, memory
from hidream_ui.model import sources as model_sources
from hidream_ui.pipeline.attention.registry import list_strategies

_PACKAGES = (
    "torch",
    "diffusers",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "peft",
    "gradio",
    "gradio_client",
    "torch_npu",
    "flash_attn",
    "pynvml",
)

# The torch_npu release whose Python sources every torch_npu / torch.npu call of this project (names,
# keywords, required arguments, defaults) and every fake NPU object of the tests were checked against
# (tests/test_npu_contract.py). That test also asserts it equals the torch_npu pin in
# requirements_npu.txt, the one place the version is chosen, so the two cannot drift apart.
NPU_CONTRACT_TORCH_NPU = "2.13.0"


def _version(name: str) -> str | None:
    dist = {"pynvml": "nvidia-ml-py", "torch_npu": "torch-npu", "flash_attn": "flash-attn"}.get(name, name)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_npu_check(version_of=None) -> dict:
    """The installed torch_npu against the release the NPU calls were checked against.

    ``version_of(name)`` returns an installed package's version or None (default: `_version`, i.e.
    importlib.metadata, which reads the version without importing torch_npu). ``warning`` is None
    when torch_npu is not installed (not an NPU machine) or is the checked release.
    """
    installed = (version_of or _version)("torch_npu")
    result = {"installed": installed, "checked_against": NPU_CONTRACT_TORCH_NPU, "warning": None}
    # Compare the release part only: a local build tag ("2.13.0+gitc798c65") is the same release.
    if installed is not None and installed.split("+", 1)[0] != NPU_CONTRACT_TORCH_NPU:
        result["warning"] = (
            f"torch_npu {installed} is installed but this project's NPU calls were checked against torch_npu "
            f"{NPU_CONTRACT_TORCH_NPU} (tests/test_npu_contract.py): a changed signature or default in {installed} "
            f"would only show up as an error at run time. Install the torch/torch_npu pair of "
            f"requirements_npu.txt, or run the contract against {installed} (docs/npu.md)"
        )
    return result


def _cann() -> dict:
    # CANN's set_env.sh exports these; without them torch_npu cannot find its runtime.
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    return {
        "ASCEND_HOME_PATH": home,
        "ASCEND_RT_VISIBLE_DEVICES": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "loaded": bool(home),
    }


def collect(config, backends=None) -> dict:
    """Builds the report; never raises for a missing piece (it is recorded instead)."""

    report: dict = {
        "hidream_ui": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in _PACKAGES},
        "torch_npu": torch_npu_check(),
        "cann": _cann(),
        "config": {
            "device": config.device,
            "dtype": config.dtype,
            "attention": config.attention,
            "variant": config.variant,
            "text_encoders": config.text_encoders,
            "refiner": config.refiner,
        },
        "problems": [],
        "warnings": [],
    }
    if report["torch_npu"]["warning"]:
        # A warning, not a problem: a newer torch_npu usually works; it just was not checked.
        report["warnings"].append(report["torch_npu"]["warning"])
    try:
        detection = detect.detect(backends=backends)
        report["backends"] = detection
    except Exception as exc:  # noqa: BLE001 - the doctor reports; it must not crash on a broken backend
        report["backends"] = {"error": repr(exc)}
    try:
        device = detect.resolve_device(config.device, backends=backends)
        report["device"] = {
            "torch_device": device.torch_device,
            "type": device.type,
            "name": device.name,
            "physical_index": device.physical_index,
            "total_memory": device.total_memory,
        }
        report["dtype_probe"] = {
            k: {"ok": ok, "detail": why} for k, (ok, why) in detect.probe_dtypes(device, backends=backends).items()
        }
        try:
            report["dtype"] = device_backends.dtype_name(detect.resolve_dtype(config.dtype, device, backends=backends))
        except device_backends.DeviceError as exc:
            report["dtype"] = None
            report["problems"].append(str(exc))
        report["memory"] = memory.snapshot(device, backends=backends).to_dict()
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(report.get("dtype"), torch.float32)
        report["attention"] = [
            {"name": s.name, "available": s.available, "reason": s.reason} for s in list_strategies(device, dtype)
        ]
    except device_backends.DeviceError as exc:
        report["device"] = None
        report["problems"].append(str(exc))

    sources = model_sources.resolve_sources(config)
    problems = model_sources.verify_sources(sources)
    report["model"] = {**sources.to_dict(), "verified": not problems, "problems": problems}
    if sources.kind == "tiny":
        report["model"]["note"] = offline_note(config)
    report["problems"].extend(problems)
    report["ok"] = not report["problems"]
    return report


def offline_note(config) -> str:
    """What the offline model in use can do: the trained default edits its world of shapes, the other profiles
    have random weights (noise)."""
    if config.uses_trained_tiny_model:
        from hidream_ui.model.tiny import world

        return (
            f"offline tiny model (--tiny-profile {config.tiny_profile}) trained on a world of coloured shapes: it "
            f"knows {world.instruction_forms('')}, not photos; point --model-dir at real weights to edit photos"
        )
    return (
        f"offline tiny random-weight model (--tiny-profile {config.tiny_profile}): outputs are noise; point "
        "--model-dir at real weights for real edits"
    )


def _print_text(report: dict) -> None:
    print(f"hidream_ui {report['hidream_ui']}  python {report['python']}  {report['platform']}")
    print("packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v))
    missing = [k for k, v in report["packages"].items() if not v]
    if missing:
        print("not installed: " + ", ".join(missing))
    npu = report["torch_npu"]
    if npu["installed"] is not None:
        print(f"torch_npu: {npu['installed']} (NPU calls checked against torch_npu {npu['checked_against']})")
    cann = report["cann"]
    print(f"CANN: {'loaded (' + cann['ASCEND_HOME_PATH'] + ')' if cann['loaded'] else 'not loaded'}")
    device = report.get("device")
    if device:
        print(f"device: {device['torch_device']} ({device['name']})  dtype: {report.get('dtype')}")
        for name, probe in report.get("dtype_probe", {}).items():
            print(f"  {name}: {'ok' if probe['ok'] else 'no'}  {probe['detail']}")
    model = report["model"]
    print(f"model: {model['variant']} ({model['kind']})  verified: {model['verified']}")
    for key in ("llama", "i1", "e1"):
        print(f"  {key}: {model[key]}")
    if model.get("note"):
        print(f"  note: {model['note']}")
    for warning in report["warnings"]:
        print(f"WARNING: {warning}")
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    print("OK" if report["ok"] else "NOT OK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui doctor", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        config = from_namespace(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = collect(config)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_text(report)
    return 0 if report["ok"] else 1
