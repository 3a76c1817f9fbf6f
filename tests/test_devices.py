"""Device detection, dtype probing, thread binding, OOM detection and generators.

Accelerators are faked (tests/fakes.py); the CPU backend and the real NPU/CUDA backends'
error paths run for real on this CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading

import psutil
import pytest
import torch
from fakes import FakeBackend, FakeCUDABackend, FakeNPUBackend, FakeTorchNPUModule

from hidream_ui.device import backends as devices_backends
from hidream_ui.device import detect
from hidream_ui.device import runtime as devices_runtime
from hidream_ui.device.backends import (
    CPUBackend,
    CUDABackend,
    DeviceError,
    DeviceInfo,
    NPUBackend,
    dtype_name,
    run_dtype_probe,
)
from hidream_ui.device.detect import (
    detect_devices,
    parse_device_spec,
    probe_dtypes,
    resolve_device,
    resolve_dtype,
)
from hidream_ui.device.runtime import bind_device_to_thread, is_oom_error, make_generator

NO_ENV: dict[str, str] = {}
CANN_MISSING = "CANN not loaded: torch_npu imported but torch.npu.is_available() is False"
NO_CUDA_BUILD = "this torch build has no CUDA support"


def table(npu=None, cuda=None, cpu=None):
    """A backend table; missing accelerators are switched-off fakes, CPU is the real one."""
    return {
        "npu": npu if npu is not None else FakeNPUBackend(available=False, reason=CANN_MISSING),
        "cuda": cuda if cuda is not None else FakeCUDABackend(available=False, reason=NO_CUDA_BUILD),
        "cpu": cpu if cpu is not None else CPUBackend(),
    }


class ProbeCountingCPU(CPUBackend):
    """The real CPU backend, counting dtype probes."""

    def __init__(self):
        self.probed: list[str] = []

    def probe_dtype(self, index, dtype):
        self.probed.append(dtype)
        return super().probe_dtype(index, dtype)


# ---------------------------------------------------------------------------------------------
# spec parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("auto", ("auto", None)),
        ("npu", ("npu", None)),
        ("NPU:3", ("npu", 3)),
        (" cuda:1 ", ("cuda", 1)),
        ("cpu", ("cpu", None)),
    ],
)
def test_parse_device_spec_accepts_documented_forms(spec, expected):
    assert parse_device_spec(spec) == expected


@pytest.mark.parametrize("spec", ["gpu", "npu:x", "cpu:0", "auto:1", "", "npu:-1", "mps"])
def test_parse_device_spec_rejects_with_the_bad_value(spec):
    with pytest.raises(DeviceError) as info:
        parse_device_spec(spec)
    assert repr(spec) in str(info.value)


# ---------------------------------------------------------------------------------------------
# auto detection order
# ---------------------------------------------------------------------------------------------


def test_auto_prefers_npu_over_cuda_and_cpu():
    npu = FakeNPUBackend(count=2, names=["Ascend910B3", "Ascend910B3"], total=64 * 2**30)
    report = detect_devices("auto", backends=table(npu=npu, cuda=FakeCUDABackend()), environ=NO_ENV, survey=False)
    assert report.error is None
    assert report.skipped == ()
    info = report.device
    assert (info.type, info.index, info.torch_device) == ("npu", 0, "npu:0")
    assert info.name == "Ascend910B3"
    assert info.total_memory == 64 * 2**30
    assert info.physical_index == 0 and info.visible_env is None
    assert info.bf16_supported is True


def test_auto_falls_back_to_cuda_and_records_why_npu_was_skipped():
    cuda = FakeCUDABackend(count=1, names=["RTX 4090"])
    report = detect_devices("auto", backends=table(cuda=cuda), environ=NO_ENV, survey=False)
    assert report.device.torch_device == "cuda:0"
    assert report.device.name == "RTX 4090"
    assert report.skipped == (("npu", CANN_MISSING),)
    assert resolve_device("auto", backends=table(cuda=cuda), environ=NO_ENV) == report.device


def test_auto_falls_back_to_cpu_with_every_reason_recorded():
    report = detect_devices("auto", backends=table(), environ=NO_ENV, survey=False)
    info = report.device
    assert (info.type, info.index, info.torch_device) == ("cpu", None, "cpu")
    assert info.total_memory == psutil.virtual_memory().total
    assert info.name
    assert report.skipped == (("npu", CANN_MISSING), ("cuda", NO_CUDA_BUILD))
    assert [status.type for status in report.backends] == ["npu", "cuda", "cpu"]
    assert [status.available for status in report.backends] == [False, False, True]


def test_auto_with_no_backend_at_all_is_an_error_listing_reasons():
    backends = {"npu": FakeNPUBackend(available=False, reason=CANN_MISSING)}
    with pytest.raises(DeviceError) as info:
        resolve_device("auto", backends=backends, environ=NO_ENV)
    message = str(info.value)
    assert CANN_MISSING in message and "no backend registered for 'cuda'" in message
    assert info.value.report is not None and info.value.report.device is None


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="this machine has torch_npu")
@pytest.mark.skipif(torch.version.cuda is not None, reason="this machine has a CUDA build of torch")
def test_auto_with_the_real_backends_on_this_machine_is_cpu_with_reasons():
    report = detect_devices("auto", environ=NO_ENV, survey=False)
    assert report.device.torch_device == "cpu"
    reasons = dict(report.skipped)
    assert "torch_npu is not installed" in reasons["npu"]
    assert "has no CUDA support" in reasons["cuda"] and torch.__version__ in reasons["cuda"]


def test_survey_asks_every_backend_but_resolution_touches_only_what_it_needs():
    npu = FakeNPUBackend()
    assert resolve_device("cpu", backends=table(npu=npu), environ=NO_ENV).type == "cpu"
    assert npu.calls == []  # --device cpu must not touch the accelerator runtime
    report = detect_devices("cpu", backends=table(npu=npu), environ=NO_ENV, survey=True)
    assert report.device.type == "cpu"
    assert {status.type: status.available for status in report.backends} == {"cpu": True, "npu": True, "cuda": False}
    assert {status.type: status.device_count for status in report.backends}["npu"] == 2


def test_detect_is_a_json_able_survey_for_doctor():
    survey = detect.detect("auto", backends=table(cuda=FakeCUDABackend(count=3)), environ=NO_ENV)
    assert json.loads(json.dumps(survey)) == survey
    assert survey["device"]["torch_device"] == "cuda:0"
    assert [(b["type"], b["available"], b["device_count"]) for b in survey["backends"]] == [
        ("npu", False, 0),
        ("cuda", True, 3),
        ("cpu", True, 1),
    ]
    assert survey["skipped"] == [["npu", CANN_MISSING]]


def test_detect_devices_reports_a_bad_spec_instead_of_raising():
    report = detect_devices("tpu", backends=table(), environ=NO_ENV)
    assert report.device is None and "'tpu'" in report.error
    assert len(report.backends) == 3  # the survey still ran, for doctor


# ---------------------------------------------------------------------------------------------
# explicit overrides and their errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, torch_device, name",
    [
        ("npu", "npu:0", "A0"),
        ("npu:1", "npu:1", "A1"),
        ("cuda", "cuda:0", "G0"),
        ("cuda:1", "cuda:1", "G1"),
        ("cpu", "cpu", None),
    ],
)
def test_explicit_override_is_taken_literally(spec, torch_device, name):
    backends = table(npu=FakeNPUBackend(names=["A0", "A1"]), cuda=FakeCUDABackend(names=["G0", "G1"]))
    info = resolve_device(spec, backends=backends, environ=NO_ENV)
    assert info.torch_device == torch_device
    assert info.type == torch_device.split(":")[0]
    if name is not None:
        assert info.name == name
        assert info.index == int(torch_device.split(":")[1]) == info.physical_index


def test_explicit_npu_that_is_missing_is_an_error_not_a_fallback():
    with pytest.raises(DeviceError) as info:
        resolve_device("npu", backends=table(), environ=NO_ENV)
    message = str(info.value)
    assert "'npu'" in message and CANN_MISSING in message


def test_explicit_index_out_of_range_names_the_count():
    with pytest.raises(DeviceError) as info:
        resolve_device("npu:5", backends=table(npu=FakeNPUBackend(count=2)), environ=NO_ENV)
    message = str(info.value)
    assert "npu:5" in message and "only 2 npu device(s)" in message and "npu:0 .. npu:1" in message


def test_real_npu_backend_says_when_torch_npu_is_not_installed():
    def import_module(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    backends = table(npu=NPUBackend(import_module=import_module))
    with pytest.raises(DeviceError) as info:
        resolve_device("npu", backends=backends, environ=NO_ENV)
    assert "torch_npu is not installed" in str(info.value)


def test_real_npu_backend_says_when_torch_npu_cannot_be_imported():
    def import_module(name):
        raise OSError("libascendcl.so: cannot open shared object file: No such file or directory")

    with pytest.raises(DeviceError) as info:
        resolve_device("npu:0", backends=table(npu=NPUBackend(import_module=import_module)), environ=NO_ENV)
    message = str(info.value)
    assert "not importable" in message and "libascendcl.so" in message and "set_env.sh" in message


def test_real_npu_backend_says_when_cann_is_not_loaded():
    class NoDeviceNPU:
        def is_available(self):
            return False

        def device_count(self):
            return 0

    backend = NPUBackend(import_module=lambda name: FakeTorchNPUModule(NoDeviceNPU()))
    with pytest.raises(DeviceError) as info:
        resolve_device("npu", backends=table(npu=backend), environ=NO_ENV)
    message = str(info.value)
    assert "CANN not loaded" in message and "torch.npu.is_available() is False" in message


def test_real_npu_backend_wraps_torch_npu_when_it_imports():
    class TwoNPUs:
        def is_available(self):
            return True

        def device_count(self):
            return 2

        def get_device_name(self, index, /):
            return f"Ascend910B-{index}"

        def mem_get_info(self, index, /):
            return 10, 100

        def is_bf16_supported(self):
            return True

    backend = NPUBackend(import_module=lambda name: FakeTorchNPUModule(TwoNPUs()))
    info = resolve_device("npu:1", backends=table(npu=backend), environ=NO_ENV)
    assert (info.torch_device, info.name, info.total_memory, info.bf16_supported) == (
        "npu:1",
        "Ascend910B-1",
        100,
        True,
    )


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="this machine has torch_npu")
def test_real_npu_backend_on_this_machine():
    with pytest.raises(DeviceError) as info:
        resolve_device("npu", environ=NO_ENV)
    assert "torch_npu is not installed" in str(info.value)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this machine has a CUDA build of torch")
def test_real_cuda_backend_says_the_cuda_build_is_missing():
    with pytest.raises(DeviceError) as info:
        resolve_device("cuda:0", backends={"cuda": CUDABackend(), "cpu": CPUBackend()}, environ=NO_ENV)
    message = str(info.value)
    assert "has no CUDA support" in message and "install a CUDA build of torch" in message


# ---------------------------------------------------------------------------------------------
# visible-devices renumbering
# ---------------------------------------------------------------------------------------------


def test_ascend_visible_devices_renumbers_and_reports_physical_ids():
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    backends = table(npu=FakeNPUBackend(count=2))
    first = resolve_device("npu", backends=backends, environ=env)
    second = resolve_device("npu:1", backends=backends, environ=env)
    assert (first.torch_device, first.physical_index) == ("npu:0", 4)
    assert (second.torch_device, second.physical_index) == ("npu:1", 5)
    assert second.visible_env == "ASCEND_RT_VISIBLE_DEVICES=4,5"
    assert "physical npu5" in second.label


def test_index_beyond_the_visible_devices_names_the_variable():
    # The runtime may report more devices than the variable exposes (here a fake with 8):
    # the variable wins.
    with pytest.raises(DeviceError) as info:
        resolve_device(
            "npu:2", backends=table(npu=FakeNPUBackend(count=8)), environ={"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
        )
    message = str(info.value)
    assert "ASCEND_RT_VISIBLE_DEVICES" in message and "only 2 npu device(s)" in message
    assert "npu:1 is physical 5" in message


def test_visible_devices_that_hide_everything_are_named_in_the_auto_reason():
    report = detect_devices(
        "auto", backends=table(npu=FakeNPUBackend()), environ={"ASCEND_RT_VISIBLE_DEVICES": ""}, survey=False
    )
    assert report.device.type == "cpu"
    assert "ASCEND_RT_VISIBLE_DEVICES" in dict(report.skipped)["npu"]


def test_cuda_visible_devices_with_uuids_gives_an_unknown_physical_id():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-1a2b,3"}
    backends = table(cuda=FakeCUDABackend(count=2))
    assert resolve_device("cuda:0", backends=backends, environ=env).physical_index is None
    assert resolve_device("cuda:1", backends=backends, environ=env).physical_index == 3


def test_unavailable_backend_reason_mentions_the_visibility_variable():
    with pytest.raises(DeviceError) as info:
        resolve_device("npu", backends=table(), environ={"ASCEND_RT_VISIBLE_DEVICES": "7"})
    assert "ASCEND_RT_VISIBLE_DEVICES=7" in str(info.value)


# ---------------------------------------------------------------------------------------------
# dtype
# ---------------------------------------------------------------------------------------------


def npu_device(**fake_options):
    backend = FakeNPUBackend(**fake_options)
    backends = table(npu=backend)
    return resolve_device("npu", backends=backends, environ=NO_ENV), backends, backend


def test_auto_dtype_is_bf16_when_the_device_has_it():
    device, backends, backend = npu_device()
    assert resolve_dtype("auto", device, backends=backends) == torch.bfloat16
    assert [call.args for call in backend.calls_to("probe_dtype")] == [(0, "bf16")]


def test_auto_dtype_falls_back_to_fp16_then_fp32():
    device, backends, backend = npu_device(bf16=False)
    assert resolve_dtype("auto", device, backends=backends) == torch.float16
    # bf16 is not even probed when the device reports no native bf16.
    assert [call.args[1] for call in backend.calls_to("probe_dtype")] == ["fp16"]

    device, backends, _ = npu_device(bf16=False, fp16=False)
    assert resolve_dtype("auto", device, backends=backends) == torch.float32


def test_auto_dtype_skips_a_dtype_whose_probe_fails_despite_the_flag():
    device, backends, backend = npu_device(bf16=True, fail_probe_dtypes={"bf16"})
    assert resolve_dtype("auto", device, backends=backends) == torch.float16
    assert [call.args[1] for call in backend.calls_to("probe_dtype")] == ["bf16", "fp16"]


def test_auto_dtype_with_nothing_working_is_an_error():
    device, backends, _ = npu_device(fail_probe_dtypes={"bf16", "fp16", "fp32"})
    with pytest.raises(DeviceError) as info:
        resolve_dtype("auto", device, backends=backends)
    message = str(info.value)
    assert "npu:0" in message and all(name in message for name in ("bf16:", "fp16:", "fp32:"))


def test_explicit_dtype_that_fails_its_probe_names_device_and_dtype():
    device, backends, _ = npu_device(bf16=False, names=["Ascend910A", "Ascend910A"])
    with pytest.raises(DeviceError) as info:
        resolve_dtype("bf16", device, backends=backends)
    message = str(info.value)
    assert "bf16" in message and "npu:0" in message and "Ascend910A" in message and "no bf16 kernels" in message


@pytest.mark.parametrize(
    "spec, expected", [("fp16", torch.float16), ("float32", torch.float32), ("BF16", torch.bfloat16)]
)
def test_explicit_dtype_that_passes_is_used(spec, expected):
    device, backends, _ = npu_device()
    assert resolve_dtype(spec, device, backends=backends) == expected


def test_bad_dtype_spec_names_the_value():
    device, backends, _ = npu_device()
    with pytest.raises(DeviceError) as info:
        resolve_dtype("int8", device, backends=backends)
    assert "'int8'" in str(info.value) and "fp32" in str(info.value)


def test_cpu_auto_dtype_is_fp32_without_probing():
    cpu = ProbeCountingCPU()
    device = resolve_device("cpu", backends={"cpu": cpu}, environ=NO_ENV)
    assert resolve_dtype("auto", device, backends={"cpu": cpu}) == torch.float32
    assert cpu.probed == []


def test_cpu_explicit_bf16_runs_a_real_probe():
    cpu = ProbeCountingCPU()
    device = resolve_device("cpu", backends={"cpu": cpu}, environ=NO_ENV)
    assert resolve_dtype("bf16", device, backends={"cpu": cpu}) == torch.bfloat16
    assert cpu.probed == ["bf16"]


def test_real_probe_on_cpu_passes_for_every_dtype():
    device = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    results = probe_dtypes(device, backends={"cpu": CPUBackend()})
    assert list(results) == ["bf16", "fp16", "fp32"]
    assert all(ok for ok, _ in results.values()), results


def test_real_probe_reports_a_device_that_cannot_compute():
    # The meta device accepts the tensors but they cannot be copied back: a real failure path.
    ok, reason = run_dtype_probe("meta", "fp32")
    assert not ok and "meta" in reason and "fp32" in reason


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_probe_judgement_rejects_wrong_or_non_finite_results(dtype):
    reference = torch.linspace(-4.0, 4.0, 16)
    assert devices_backends.judge_probe(dtype, "npu:0", reference.clone(), reference)[0]
    off = devices_backends.judge_probe(dtype, "npu:0", reference + 0.5, reference)
    assert not off[0] and "off by" in off[1] and dtype in off[1]
    broken = reference.clone()
    broken[3] = float("nan")
    assert not devices_backends.judge_probe(dtype, "npu:0", broken, reference)[0]
    # Rounding as coarse as the dtype itself is accepted.
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    assert devices_backends.judge_probe(dtype, "npu:0", (reference * 1.0001).to(torch_dtype).float(), reference)[0]


def test_dtype_name_round_trip():
    assert [dtype_name(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == ["bf16", "fp16", "fp32"]
    with pytest.raises(DeviceError):
        dtype_name(torch.int8)


# ---------------------------------------------------------------------------------------------
# threads and housekeeping
# ---------------------------------------------------------------------------------------------


def test_bind_device_to_thread_sets_the_device_in_the_calling_worker_thread():
    npu = FakeNPUBackend(count=2)
    backends = table(npu=npu)
    device = resolve_device("npu:1", backends=backends, environ=NO_ENV)
    seen_in_worker: list[int] = []

    def worker():
        bind_device_to_thread(device, backends=backends)
        seen_in_worker.append(npu.current_device())

    thread = threading.Thread(target=worker, name="gradio-worker")
    thread.start()
    thread.join()

    calls = npu.calls_to("set_device")
    assert [(call.args, call.thread_name) for call in calls] == [((1,), "gradio-worker")]
    assert calls[0].thread_id != threading.get_ident()
    assert seen_in_worker == [1]
    assert npu.current_device() == 0  # the main thread was not rebound


def test_bind_device_to_thread_is_a_no_op_on_cpu():
    fake_cpu = FakeBackend(count=1)
    device = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    bind_device_to_thread(device, backends={"cpu": fake_cpu})
    assert fake_cpu.calls_to("set_device") == []
    bind_device_to_thread(device, backends={"cpu": CPUBackend()})  # the real one does not raise


def test_bind_failure_names_device_and_thread():
    npu = FakeNPUBackend(count=2)
    real = resolve_device("npu:1", backends=table(npu=npu), environ=NO_ENV)
    device = dataclasses.replace(real, index=7, torch_device="npu:7")  # e.g. the device vanished
    with pytest.raises(DeviceError) as info:
        bind_device_to_thread(device, backends=table(npu=npu))
    assert "npu:7" in str(info.value) and threading.current_thread().name in str(info.value)


@pytest.mark.slow
def test_housekeeping_goes_to_the_right_backend_and_index():
    npu = FakeNPUBackend(count=2, allocated=1, peak=9, reserved=8, active=2)
    backends = table(npu=npu)
    device = resolve_device("npu:1", backends=backends, environ=NO_ENV)
    devices_runtime.synchronize(device, backends=backends)
    devices_runtime.reset_peak(device, backends=backends)
    devices_runtime.free_memory(device, backends=backends)
    assert [call.args for call in npu.calls_to("synchronize")] == [(1,)]
    assert [call.args for call in npu.calls_to("reset_peak_memory_stats")] == [(1,)]
    assert len(npu.calls_to("empty_cache")) == 1
    assert (npu.peak, npu.reserved) == (1, 2)


@pytest.mark.slow
def test_housekeeping_on_cpu_is_harmless():
    device = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    for operation in (
        devices_runtime.synchronize,
        devices_runtime.empty_cache,
        devices_runtime.reset_peak,
        devices_runtime.free_memory,
    ):
        operation(device, backends={"cpu": CPUBackend()})


def test_unknown_device_type_is_a_clear_error():
    device = resolve_device("npu", backends=table(npu=FakeNPUBackend()), environ=NO_ENV)
    with pytest.raises(DeviceError) as info:
        devices_runtime.synchronize(device, backends={"cpu": CPUBackend()})
    assert "'npu'" in str(info.value)


# ---------------------------------------------------------------------------------------------
# OOM detection
# ---------------------------------------------------------------------------------------------


def chained(outer: Exception, cause: BaseException) -> Exception:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except Exception as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("NPU out of memory. Tried to allocate 1.50 GiB (NPU 0; 60.96 GiB total capacity)"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("aclrtMalloc failed: ACL_ERROR_RT_MEMORY_ALLOCATION"),
        MemoryError(),
    ],
)
def test_oom_errors_are_recognised(exc):
    assert is_oom_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
        ValueError("out of memory budget is not a number"),
        KeyError("memory"),
        DeviceError("device 'npu' was requested but npu is not usable"),
    ],
)
def test_other_errors_are_not_oom(exc):
    assert not is_oom_error(exc)


def test_oom_is_found_through_an_explicit_cause_chain():
    assert is_oom_error(chained(RuntimeError("edit failed"), RuntimeError("NPU out of memory.")))
    assert not is_oom_error(chained(RuntimeError("edit failed"), RuntimeError("bad prompt")))


def test_a_real_cpu_allocation_failure_is_oom():
    with pytest.raises(Exception) as info:
        torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: fails at once, allocates nothing
    assert is_oom_error(info.value)


# ---------------------------------------------------------------------------------------------
# generators and DeviceInfo
# ---------------------------------------------------------------------------------------------


def test_same_seed_gives_the_same_noise_on_the_default_cpu_generator():
    cpu = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    npu = resolve_device("npu", backends=table(npu=FakeNPUBackend()), environ=NO_ENV)
    first = torch.randn((2, 4, 4), generator=make_generator(1234, cpu))
    # The generator does not depend on the compute device, so an NPU run starts from this too.
    again = torch.randn((2, 4, 4), generator=make_generator(1234, npu))
    other = torch.randn((2, 4, 4), generator=make_generator(1235, cpu))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert make_generator(1234, npu).device.type == "cpu"
    assert make_generator(7, cpu, on_device=True).device.type == "cpu"


def test_on_device_generator_is_created_on_the_compute_device(monkeypatch):
    created: list[str] = []
    real_generator = torch.Generator

    def recording_generator(device="cpu"):
        created.append(str(device))
        return real_generator(device="cpu")  # torch here cannot build an npu generator

    monkeypatch.setattr(torch, "Generator", recording_generator)
    npu = resolve_device("npu:1", backends=table(npu=FakeNPUBackend()), environ=NO_ENV)
    make_generator(5, npu)
    make_generator(5, npu, on_device=True)
    assert created == ["cpu", "npu:1"]


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "3", True])
def test_bad_seed_is_rejected(seed):
    cpu = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    with pytest.raises(DeviceError) as info:
        make_generator(seed, cpu)
    assert repr(seed) in str(info.value)


def test_device_info_is_frozen_and_builds_a_torch_device():
    info = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ=NO_ENV)
    assert info.torch == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.index = 3  # type: ignore[misc]
    assert info.to_dict()["torch_device"] == "cpu"
    assert isinstance(info, DeviceInfo)


def test_default_backends_are_built_fresh_each_time():
    first, second = devices_backends.default_backends(), devices_backends.default_backends()
    assert set(first) == {"npu", "cuda", "cpu"}
    assert first is not second and first["npu"] is not second["npu"]
