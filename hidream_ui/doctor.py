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

from . import __version__
from .config import ConfigError, add_model_arguments, from_namespace

_PACKAGES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "gradio",
             "gradio_client", "torch_npu", "flash_attn", "pynvml")


def _version(name: str) -> str | None:
    dist = {"pynvml": "nvidia-ml-py", "torch_npu": "torch-npu", "flash_attn": "flash-attn"}.get(name, name)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cann() -> dict:
    # CANN's set_env.sh exports these; without them torch_npu cannot find its runtime.
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    return {"ASCEND_HOME_PATH": home, "ASCEND_RT_VISIBLE_DEVICES": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "loaded": bool(home)}


def collect(config, backends=None) -> dict:
    """Builds the report; never raises for a missing piece (it is recorded instead)."""
    from . import devices, memory, models

    report: dict = {
        "hidream_ui": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in _PACKAGES},
        "cann": _cann(),
        "config": {"device": config.device, "dtype": config.dtype, "attention": config.attention,
                   "variant": config.variant, "text_encoders": config.text_encoders, "refiner": config.refiner},
        "problems": [],
    }
    try:
        detection = devices.detect(backends=backends)
        report["backends"] = detection
    except Exception as exc:  # noqa: BLE001 - the doctor reports; it must not crash on a broken backend
        report["backends"] = {"error": repr(exc)}
    try:
        device = devices.resolve_device(config.device, backends=backends)
        report["device"] = {"torch_device": device.torch_device, "type": device.type, "name": device.name,
                            "physical_index": device.physical_index, "total_memory": device.total_memory}
        report["dtype_probe"] = {k: {"ok": ok, "detail": why}
                                 for k, (ok, why) in devices.probe_dtypes(device, backends=backends).items()}
        try:
            report["dtype"] = devices.dtype_name(devices.resolve_dtype(config.dtype, device, backends=backends))
        except devices.DeviceError as exc:
            report["dtype"] = None
            report["problems"].append(str(exc))
        report["memory"] = memory.snapshot(device, backends=backends).to_dict()
        from .attention import list_strategies

        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(report.get("dtype"), torch.float32)
        report["attention"] = [
            {"name": s.name, "available": s.available, "reason": s.reason} for s in list_strategies(device, dtype)]
    except devices.DeviceError as exc:
        report["device"] = None
        report["problems"].append(str(exc))

    sources = models.resolve_sources(config)
    problems = models.verify_sources(sources)
    report["model"] = {**sources.to_dict(), "verified": not problems, "problems": problems}
    if sources.kind == "tiny":
        report["model"]["note"] = ("offline tiny random-weight model: outputs are noise; "
                                   "point --model-dir at real weights for real edits")
    report["problems"].extend(problems)
    report["ok"] = not report["problems"]
    return report


def _print_text(report: dict) -> None:
    print(f"hidream_ui {report['hidream_ui']}  python {report['python']}  {report['platform']}")
    print("packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v))
    missing = [k for k, v in report["packages"].items() if not v]
    if missing:
        print("not installed: " + ", ".join(missing))
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
