"""The engine pool (`--devices`): one engine per device, jobs on idle engines, batches spread in order.

The 4-NPU tests run real EditEngines with a fake NPU backend (tests/fakes.py): device resolution,
dtype probing, per-thread `set_device`, memory figures and the pool's dispatch are the real code;
only the tensors stay on the CPU (`cpu_tensors` loads the tiny model on the CPU and labels it with
the fake card), because this machine has no NPU.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fakes import FakeNPUBackend
from helpers import edit_params, random_picture

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.device.backends import CPUBackend
from hidream_ui.edits import EditRequest, EditSettings
from hidream_ui.engine.batch import BatchRequest, BatchSource
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.pool import EnginePool, engine_labels
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS


@pytest.fixture
def cpu_tensors(monkeypatch, tiny_cache):
    """Loads the model's tensors on the CPU whatever device the engine resolved (the fake NPU's
    DeviceInfo stays on the LoadedModel, so the engine binds and measures the fake card)."""
    from hidream_ui.device.detect import resolve_device
    from hidream_ui.model import loading

    real = loading.load_model
    cpu = resolve_device("cpu")

    def load(config, device, dtype, on_progress=None, sources=None, plan=None):
        model = real(config, cpu, dtype, on_progress=on_progress, sources=sources, plan=plan)
        return dataclasses.replace(model, device=device)

    monkeypatch.setattr(loading, "load_model", load)


def npu_pool(tmp_path, count: int) -> tuple[EnginePool, FakeNPUBackend]:
    npu = FakeNPUBackend(count=count, names=[f"Ascend910B3-{i}" for i in range(count)])
    backends = {"npu": npu, "cpu": CPUBackend()}
    config = AppConfig(
        devices=tuple(f"npu:{i}" for i in range(count)), dtype="fp32", attention="sdpa", output_dir=tmp_path
    )
    return EnginePool.for_config(config, backends=backends), npu


@pytest.mark.slow
def test_eight_concurrent_jobs_on_four_fake_npus_run_two_per_card_each_bound_in_its_thread(tmp_path, cpu_tensors):
    pool, npu = npu_pool(tmp_path, 4)
    assert pool.size == 4
    # Four jobs must be inside the pipeline at the same time before any goes on: proves the four
    # engines compute at once (and, with one job per engine at a time, on four different cards).
    together = threading.Barrier(4, timeout=120)
    computing: dict[int, set[int]] = {}  # job -> threads that ran its steps

    def job(number: int):
        def on_step(info):
            computing.setdefault(number, set()).add(threading.get_ident())
            if info.step == 1:
                together.wait()

        request = EditRequest(image=random_picture(number), params=edit_params(seed=number, steps=2))
        return pool.edit(request, on_step, save=False)

    with ThreadPoolExecutor(8) as executor:
        results = list(executor.map(job, range(8)))

    per_card = {f"npu:{i}": sum(1 for r in results if r.info.device == f"npu:{i}") for i in range(4)}
    assert per_card == {"npu:0": 2, "npu:1": 2, "npu:2": 2, "npu:3": 2}
    assert {r.info.engine for r in results} == {"npu:0", "npu:1", "npu:2", "npu:3"}
    set_calls = {(call.thread_id, call.args[0]) for call in npu.calls_to("set_device")}
    for number, result in enumerate(results):
        card = int(result.info.device.split(":")[1])
        (thread,) = computing[number]
        # The card of the engine that ran the job was made current in the very thread that computed it.
        assert (thread, card) in set_calls, f"job {number}: set_device({card}) not called in its computing thread"
    assert {slot.label: slot.jobs for slot in pool.slots} == {"npu:0": 2, "npu:1": 2, "npu:2": 2, "npu:3": 2}
    # Model builds (loads and the planner's meta builds) set torch's process-wide default dtype to the
    # load dtype (bf16 here) and restore it; run side by side in threads they used to leave it at bf16.
    import torch

    assert torch.get_default_dtype() == torch.float32


@pytest.mark.slow
def test_a_batch_over_the_pool_keeps_its_order_and_names_each_items_device(tmp_path, cpu_tensors):
    pool, _ = npu_pool(tmp_path, 2)
    settings = EditSettings(num_inference_steps=2, working_resolution="draft")
    batch = BatchRequest(
        sources=tuple(BatchSource(f"img{i}.png", random_picture(i)) for i in range(3)),
        instructions=("make it blue", "make it red"),
        settings=settings,
        seed=10,
        seed_policy="increment",
        batch_size=1,
    )
    finished = []
    result = pool.run_batch(batch, on_item=lambda item: finished.append(item.index))

    assert [item.index for item in result.items] == list(range(6))
    assert all(item.status == "ok" for item in result.items)
    assert [item.result.params.seed for item in result.items] == list(range(10, 16))
    assert [item.instruction for item in result.items] == ["make it blue", "make it red"] * 3
    sidecars = [json.loads(item.result.saved_json.read_text()) for item in result.items]
    assert {meta["device"] for meta in sidecars} == {"npu:0", "npu:1"}  # spread over both cards
    for meta in sidecars:  # each saved sidecar says where its item ran
        assert meta["engine"] == meta["device"] and meta["device_name"] == f"Ascend910B3-{meta['device'][-1]}"
    assert sorted(finished) == list(range(6))
    assert result.stats["edits"] == 6


@pytest.mark.slow
def test_a_pool_batch_gives_the_images_of_one_engine(tmp_path, tiny_cache):
    """cpu,cpu: two real engines (one core each) against one engine with one core, same seeds: the
    same images to one 8-bit level. Not bit for bit: the BLAS library's thread count is process-wide
    (MKL), so while the other engine's thread sets or restores its share, a GEMM may run on another
    thread count and sum in another order (seen once in three runs after a busy module)."""
    import torch

    threads = torch.get_num_threads()
    config = AppConfig(device="cpu", output_dir=tmp_path / "one")
    settings = EditSettings(num_inference_steps=2, working_resolution="draft")
    batch = BatchRequest(
        sources=(BatchSource("a.png", random_picture(1)), BatchSource("b.png", random_picture(2))),
        instructions=("make it blue",),
        settings=settings,
        seed=5,
        seed_policy="increment",
        batch_size=1,
    )
    try:
        single = EnginePool(config, [EditEngine(config)], threads=[1]).edit
        reference = [
            single(
                EditRequest(image=random_picture(i), params=edit_params("make it blue", seed=4 + i, steps=2)),
                save=False,
            )
            for i in (1, 2)
        ]
        pool = EnginePool.for_config(
            config.replace(device="auto", devices=("cpu", "cpu"), output_dir=tmp_path / "two"), cores=2
        )
        assert [slot.threads for slot in pool.slots] == [1, 1]
        spread = pool.run_batch(batch)
    finally:
        torch.set_num_threads(threads)  # the pool's threads set the process default too
    assert [item.result.info.engine for item in spread.items] == ["cpu#1", "cpu#2"]
    for one, two in zip(reference, spread.items):
        assert one.params.seed == two.seed
        diff = np.abs(np.asarray(one.image, dtype=np.int16) - np.asarray(two.result.image, dtype=np.int16))
        assert diff.max() <= 1, f"seed {two.seed}: images differ by up to {diff.max()} levels"


def test_a_cancelled_job_stops_waiting_for_a_busy_pool(tmp_path):
    from hidream_ui.engine.errors import EditCancelled
    from hidream_ui.engine.jobs import CancelToken

    pool = EnginePool(AppConfig(device="cpu", output_dir=tmp_path), [EditEngine(AppConfig(device="cpu"))])
    token = CancelToken()
    with pool.acquire():
        threading.Timer(0.3, token.cancel).start()
        with pytest.raises(EditCancelled, match="waiting for a free device"):
            with pool.acquire(token):
                pass


def test_the_speed_setting_applies_to_every_engine_and_a_bad_value_to_none(tmp_path):
    from hidream_ui.engine.errors import EngineError

    config = AppConfig(devices=("cpu", "cpu"), output_dir=tmp_path)
    pool = EnginePool.for_config(config, cores=2)
    assert pool.set_speed("fast") == SPEED_PRESETS["fast"]
    assert [engine.status().speed["cache_default"] for engine in pool.engines] == [SPEED_PRESETS["fast"]] * 2
    with pytest.raises(EngineError, match="bogus"):
        pool.set_speed("bogus")
    assert [engine.status().speed["cache_default"] for engine in pool.engines] == [SPEED_PRESETS["fast"]] * 2


def test_status_has_one_row_per_engine_and_the_busiest_state(tmp_path):
    npu = FakeNPUBackend(count=2)
    config = AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path)
    pool = EnginePool.for_config(config, backends={"npu": npu, "cpu": CPUBackend()})
    status = pool.status()
    assert [row.engine for row in status.devices] == ["npu:0", "npu:1"]
    assert [row.device_name for row in status.devices] == ["FakeNPU-0", "FakeNPU-1"]
    assert status.devices[1].memory.allocated == npu.allocated
    assert status.state == "idle"
    pool.engines[1]._state = "editing"  # what an edit sets while it runs
    assert pool.status().state == "editing"
    assert pool.status().to_dict()["devices"][1]["state"] == "editing"


def test_labels_number_repeated_devices_only():
    assert engine_labels(["npu:0", "npu:1"]) == ["npu:0", "npu:1"]
    assert engine_labels(["cpu", "cpu"]) == ["cpu#1", "cpu#2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "npu:0,npu:0"], "names npu:0 twice"),
        (["--devices", "npu:0,cuda:0"], "mixes device types"),
        (["--devices", "npu:0", "--device", "npu:1"], "are exclusive"),
        (["--devices", "all,npu:1"], "'all' stands alone"),
        (["--devices", "tpu:0"], "'tpu:0'"),
        (["--devices", "npu:0,,npu:1"], "comma-separated"),
        (["--devices", "auto"], "not auto"),
        (["--placement", "encoders=npu:1"], "name the transformer's device"),
        (["--placement", "transformer=npu:0,unet=npu:1"], "'unet=npu:1'"),
        (["--placement", "transformer=npu:0,encoders=npu:1", "--devices", "npu:0,npu:1"], "use one of them"),
        (["--placement", "transformer=npu:0,encoders=cpu", "--text-encoders", "offload"], "--text-encoders offload"),
        (["--placement", "transformer=npu:0", "--device", "npu:1"], "disagree"),
    ],
)
def test_bad_devices_and_placement_are_refused_naming_the_value(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_args(argv, environ={})


def test_devices_and_placement_parse_from_flags_and_env():
    assert from_args(["--devices", "NPU:0, npu:1"], environ={}).devices == ("npu:0", "npu:1")
    assert from_args([], environ={"HIDREAM_DEVICES": "cpu,cpu"}).devices == ("cpu", "cpu")
    assert from_args(["--devices", "all"], environ={}).devices == ("all",)
    config = from_args(["--placement", "transformer=npu:0,encoders=npu:1,vae=npu:1"], environ={})
    assert config.placement == (("transformer", "npu:0"), ("encoders", "npu:1"), ("vae", "npu:1"))


def test_devices_all_takes_every_visible_accelerator(tmp_path):
    npu = FakeNPUBackend(count=3)
    pool = EnginePool.for_config(
        AppConfig(devices=("all",), output_dir=tmp_path), backends={"npu": npu, "cpu": CPUBackend()}
    )
    assert [slot.label for slot in pool.slots] == ["npu:0", "npu:1", "npu:2"]
    off = FakeNPUBackend(available=False)
    cpu_only = EnginePool.for_config(
        AppConfig(devices=("all",), output_dir=tmp_path), backends={"npu": off, "cpu": CPUBackend()}
    )
    assert [slot.label for slot in cpu_only.slots] == ["cpu"]


def test_the_device_lane_admits_one_job_per_engine(tmp_path):
    from hidream_ui.ui.layout import build_demo

    npu = FakeNPUBackend(count=3)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1", "npu:2"), output_dir=tmp_path), backends={"npu": npu, "cpu": CPUBackend()}
    )
    demo = build_demo(pool)
    limits = {fn.api_name: fn.concurrency_limit for fn in demo.fns.values() if fn.api_name}
    assert limits["edit"] == 3 and limits["batch_edit"] == 3 and limits["compare"] == 3
    single = build_demo(EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path)))
    assert {fn.api_name: fn.concurrency_limit for fn in single.fns.values() if fn.api_name}["edit"] == 1


def test_placement_puts_the_transformer_on_the_engine_device_and_the_rest_where_named(tmp_path):
    from hidream_ui.device.pool_spec import Placement, placement_for

    config = from_args(["--placement", "transformer=npu:1,encoders=npu:0,vae=npu:0"], environ={})
    npu = FakeNPUBackend(count=2)
    engine = EditEngine(config.replace(output_dir=tmp_path), backends={"npu": npu, "cpu": CPUBackend()})
    assert engine.device.torch_device == "npu:1"  # the transformer's card is the engine's card
    placed = placement_for(config.placement, "npu:1", config.text_encoders)
    assert placed == Placement(transformer="npu:1", encoders="npu:0", vae="npu:0") and placed.split
    # Without --placement: today's rule (--text-encoders decides where the encoders go).
    assert placement_for((), "npu:0", "cpu").encoders == "cpu"
    assert placement_for((), "npu:0", "device").encoders == "npu:0" and not placement_for((), "npu:0", "device").split


@pytest.mark.slow
def test_split_placement_runs_the_tiny_model_and_gives_the_same_image(tmp_path, tiny_cache):
    """This machine has one device (the CPU), so the parts are placed on it by name: the placed
    loader and the pipeline's moves between the VAE's, the encoders' and the transformer's device run
    for real; a second card is what it cannot show (README "What cannot be tested here")."""
    request = EditRequest(image=random_picture(7), params=edit_params(seed=7, steps=2))
    plain = EditEngine(AppConfig(device="cpu", output_dir=tmp_path)).edit(request, save=False)
    # The tiny profile named: with no environment the CLI's default is the trained model, not AppConfig()'s.
    argv = ["--placement", "transformer=cpu,encoders=cpu,vae=cpu", "--tiny-profile", "tiny"]
    placed_engine = EditEngine(from_args(argv, environ={}).replace(output_dir=tmp_path))
    placed = placed_engine.edit(request, save=False)
    pipe = placed_engine.model.pipeline
    assert {pipe.text_encoder_4.device.type, pipe.vae.device.type, pipe.transformer.device.type} == {"cpu"}
    assert np.array_equal(np.asarray(plain.image), np.asarray(placed.image))


@pytest.mark.slow
def test_status_api_returns_one_row_per_engine_of_a_cpu_pool(tmp_path, tiny_cache):
    from gradio_client import Client

    from hidream_ui.bench import free_port
    from hidream_ui.cli.app import launch

    config = AppConfig(devices=("cpu", "cpu"), output_dir=tmp_path, port=free_port())
    demo, url = launch(config, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False)
        status = client.predict(api_name="/status")
        assert [row["engine"] for row in status["devices"]] == ["cpu#1", "cpu#2"]
        assert all(row["state"] == "idle" and not row["loaded"] for row in status["devices"])
        # Telemetry is collected in the background: a later poll has psutil's figures.
        rows = wait_for_rows(client)
        assert all(row["telemetry"]["source"] == "psutil" and row["telemetry"]["per_core"] for row in rows)
        client.close()
    finally:
        demo.close()


def wait_for_rows(client):
    from helpers import wait_for

    def ready():
        rows = client.predict(api_name="/status")["devices"]
        return rows if all(row["telemetry"] and row["telemetry"]["source"] == "psutil" for row in rows) else None

    return wait_for(ready, "psutil telemetry in /status", timeout=20)


@pytest.mark.slow
def test_a_comparison_switches_attention_on_its_own_engine_only(tmp_path, cpu_tensors, monkeypatch):
    """An attention grid on a pool: every cell on one engine, whose attention is switched and
    restored; the other engines (serving other people's jobs meanwhile) are never switched."""
    from hidream_ui.engine.compare import run_compare

    pool, _ = npu_pool(tmp_path, 2)
    switched: list[tuple[str, str]] = []
    for slot in pool.slots:
        original = slot.engine.set_attention
        monkeypatch.setattr(
            slot.engine,
            "set_attention",
            lambda name, label=slot.label, original=original: switched.append((label, name)) or original(name),
        )
    result = run_compare(pool, random_picture(3), edit_params(seed=3, steps=1), "attention", "math, sdpa", save=False)
    (engine,) = {cell.info.engine for cell in result.cells}
    assert [cell.info.attention for cell in result.cells] == ["math", "sdpa"]
    assert {label for label, _ in switched} == {engine}, switched
    assert [slot.engine.attention_request for slot in pool.slots] == ["sdpa", "sdpa"]
    assert all(not slot.busy for slot in pool.slots)


def test_a_pool_attention_switch_waits_for_the_job_running_on_each_engine(tmp_path):
    npu = FakeNPUBackend(count=2)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", attention="sdpa", output_dir=tmp_path),
        backends={"npu": npu, "cpu": CPUBackend()},
    )
    with pool.acquire() as held:  # a job (a comparison between two of its cells) holds engine 0
        switch = threading.Thread(target=pool.set_attention, args=("math",))
        switch.start()
        switch.join(0.5)
        assert switch.is_alive() and held.engine.attention_request == "sdpa"  # not under the running job
    switch.join(10)
    assert [engine.attention_request for engine in pool.engines] == ["math", "math"]
    assert [slot.jobs for slot in pool.slots] == [1, 0]  # a switch is not a job


def test_a_failed_background_load_is_reported_and_its_engine_gets_no_jobs(tmp_path, monkeypatch):
    from helpers import wait_for

    from hidream_ui.engine.errors import EditCancelled
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.ui.devices_panel import render_device_rows

    npu = FakeNPUBackend(count=2)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path),
        backends={"npu": npu, "cpu": CPUBackend()},
    )
    started = threading.Event()

    def broken(on_progress=None):
        raise RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(pool.engines[0], "load", lambda on_progress=None: started.set())
    monkeypatch.setattr(pool.engines[1], "load", broken)
    pool.start_loading()
    rows = wait_for(lambda: (rows := pool.status().devices)[1].error and rows, "the failed load in the row")
    assert "NPU out of memory" in rows[1].error and rows[0].error is None
    assert "NPU out of memory" in render_device_rows(rows)
    assert started.wait(5)
    # Engine 0 is busy: the next job waits for it instead of failing the same way on engine 1.
    token = CancelToken()
    with pool.acquire() as first:
        assert first.index == 0
        threading.Timer(0.5, token.cancel).start()
        with pytest.raises(EditCancelled):
            with pool.acquire(token):
                pass
    # Every engine failed: a job goes to one anyway (it tries the load again and reports why).
    pool.slots[0].load_error = "loading the model failed: also broken"
    with pool.acquire() as slot:
        assert slot.index in (0, 1)


def test_an_app_without_login_shows_no_server_paths_in_the_device_rows(tmp_path):
    from hidream_ui.ui.services import AppServices
    from hidream_ui.ui.system_handlers import SystemHandlers

    npu = FakeNPUBackend(count=2)
    config = AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path)
    pool = EnginePool.for_config(config, backends={"npu": npu, "cpu": CPUBackend()})
    pool.engines[0]._last_error = "the configured model is incomplete: /srv/models/HiDream-E1-1/transformer missing"
    pool.slots[1].load_error = "loading the model failed: /srv/models/Llama-3.1-8B-Instruct/config.json unreadable"
    handlers = SystemHandlers(pool, services=AppServices.for_config(config))
    assert handlers.services.public
    status = handlers.status()
    assert "/srv/models" not in json.dumps(status, default=str) and "/srv/models" not in handlers.status_panel()
    assert [row["error"] for row in status["devices"]] == [
        "the configured model is incomplete: transformer missing",
        "loading the model failed: config.json unreadable",
    ]


def test_an_engines_share_of_the_cores_ends_with_its_job(tmp_path):
    """cpu,cpu on 4 cores: 2 threads per engine while it computes; afterwards the worker thread,
    and any thread started later, has the process's count again (torch starts a new thread from
    the last count set anywhere)."""
    import torch

    default = torch.get_num_threads()
    pool = EnginePool.for_config(AppConfig(devices=("cpu", "cpu"), output_dir=tmp_path), cores=2 * default + 2)
    share = pool.slots[0].threads
    assert share != default
    seen = {}

    def job():
        with pool.acquire():
            seen["during"] = torch.get_num_threads()
        seen["after"] = torch.get_num_threads()

    def later():
        seen["new thread"] = torch.get_num_threads()

    try:
        for target in (job, later):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(default)
    assert seen == {"during": share, "after": default, "new thread": default}


def test_the_loader_puts_each_part_on_its_placed_device(tmp_path, tiny_cache, monkeypatch):
    """The loader reads `--placement` for every part (the moves to cards this machine lacks are
    recorded, not made; the split run itself is tested on the CPU above)."""
    import torch

    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.model.loading import load_model

    moves: dict[str, set[str]] = {}
    real_to = torch.nn.Module.to

    def to(module, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, str) and target.startswith("npu"):
            moves.setdefault(type(module).__name__, set()).add(target)
            return module
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    config = from_args(["--placement", "transformer=npu:0,encoders=npu:1,vae=npu:1"], environ={})
    card = DeviceInfo(type="npu", index=0, torch_device="npu:0", name="fake", physical_index=0)
    model = load_model(config.replace(output_dir=tmp_path), card, torch.float32)
    pipe = model.pipeline
    assert moves[type(pipe.transformer).__name__] == {"npu:0"} and moves[type(pipe.vae).__name__] == {"npu:1"}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        assert moves[type(getattr(pipe, name)).__name__] == {"npu:1"}, name
    assert pipe.compute_device == "npu:0"


def test_load_loads_the_first_engine_in_the_callers_thread_with_its_progress(tmp_path, monkeypatch):
    """The Load button: the first engine loads in the handler's thread and reports its progress
    (exactly once: a background load of it would leave the button waiting without a word); the
    others load in the background."""
    npu = FakeNPUBackend(count=2)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path),
        backends={"npu": npu, "cpu": CPUBackend()},
    )
    from helpers import wait_for

    calls: list[tuple[int, str, bool]] = []
    for index, engine in enumerate(pool.engines):

        def load(on_progress=None, index=index):
            calls.append((index, threading.current_thread().name, on_progress is not None))
            if on_progress is not None:
                on_progress(0.5, "loading")

        monkeypatch.setattr(engine, "load", load)
    progress = []
    pool.load(on_progress=lambda fraction, message: progress.append(fraction))
    wait_for(lambda: len(calls) == 2, "the second engine's load")
    assert calls == [(0, threading.current_thread().name, True), (1, "hidream-load-npu:1", False)]
    assert progress == [0.5]


def test_a_cpu_pool_status_shows_the_cpu_load(tmp_path):
    """Every engine of `cpu,cpu` reads the host's load in one poll: the later readers must not
    measure the microseconds since the first (0 %), the top-level bar least of all."""
    import time

    pool = EnginePool.for_config(AppConfig(devices=("cpu", "cpu"), output_dir=tmp_path))
    pool.status()
    deadline = time.perf_counter() + 0.8
    while time.perf_counter() < deadline:  # keep one core busy
        sum(range(10_000))
    status = pool.status()
    assert status.memory.utilization > 0
    assert [row.memory.utilization for row in status.devices] == [status.memory.utilization] * 2


def test_the_load_button_tries_a_failed_engine_again(tmp_path, monkeypatch):
    from helpers import wait_for

    npu = FakeNPUBackend(count=2)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path),
        backends={"npu": npu, "cpu": CPUBackend()},
    )
    attempts = []

    def flaky(on_progress=None):
        attempts.append(threading.current_thread().name)
        raise RuntimeError("NPU out of memory (another process held the card)")

    monkeypatch.setattr(pool.engines[0], "load", lambda on_progress=None: None)
    monkeypatch.setattr(pool.engines[1], "load", flaky)
    pool.start_loading()
    wait_for(lambda: pool.slots[1].failed, "the failed background load")
    pool.load()
    wait_for(lambda: len(attempts) == 2, "a second try of the failed engine")
    assert attempts == ["hidream-load-npu:1"] * 2


def test_background_loads_go_in_pool_order_so_the_first_job_waits_for_its_engine_only(tmp_path, monkeypatch):
    """The loads run one at a time (the loader's lock). Engine 0 (the first job's) still probes its
    dtype when the others could take the lock: they must not load before it."""
    import time

    from helpers import wait_for

    from hidream_ui.model import loading

    npu = FakeNPUBackend(count=3)
    pool = EnginePool.for_config(
        AppConfig(devices=("npu:0", "npu:1", "npu:2"), dtype="fp32", output_dir=tmp_path),
        backends={"npu": npu, "cpu": CPUBackend()},
    )
    order: list[int] = []
    for index, engine in enumerate(pool.engines):

        def load(on_progress=None, index=index):
            if index == 0:
                time.sleep(0.3)  # the dtype probe before the load (a subprocess on a card)
            with loading.BUILD_LOCK:
                order.append(index)
                time.sleep(0.05)

        monkeypatch.setattr(engine, "load", load)
    pool.start_loading()
    wait_for(lambda: len(order) == 3, "three loads")
    assert order == [0, 1, 2]


def test_the_live_plot_reads_cached_telemetry_only(tmp_path, monkeypatch):
    """The plot's timer tick comes beside the panel's: it must not compute the engines' status
    (allocator and utilisation queries per device) a second time, only read the sampler's history."""
    import time

    from hidream_ui.device.telemetry import TelemetryPoint
    from hidream_ui.engine.pool import shared_sampler
    from hidream_ui.ui.services import AppServices
    from hidream_ui.ui.system_handlers import SystemHandlers

    npu = FakeNPUBackend(count=2)
    config = AppConfig(devices=("npu:0", "npu:1"), dtype="fp32", output_dir=tmp_path)
    pool = EnginePool.for_config(config, backends={"npu": npu, "cpu": CPUBackend()})
    handlers = SystemHandlers(pool, services=AppServices.for_config(config))
    sampler = shared_sampler()
    with sampler._lock:
        sampler._history.append(TelemetryPoint(time.time(), "npu:1", 75.0, 40.0))

    def no_status():
        raise AssertionError("the plot computed the engine status")

    for engine in pool.engines:
        monkeypatch.setattr(engine, "status", no_status)
    frame = handlers.telemetry_plot()
    assert {(row.percent, row.series) for row in frame.itertuples()} >= {
        (40.0, "npu:1 memory"),
        (75.0, "npu:1 utilisation"),
    }


def cpu_pool(tmp_path, attention: str = "sdpa") -> EnginePool:
    return EnginePool.for_config(AppConfig(devices=("cpu", "cpu"), attention=attention, output_dir=tmp_path), cores=2)


def test_an_attention_switch_on_one_engine_leaves_the_others_strategy_unchanged(tmp_path):
    from hidream_ui.engine.errors import EngineError

    pool = cpu_pool(tmp_path)
    assert pool.set_attention("math", engine="cpu#2") == "math"
    assert [engine.attention_request for engine in pool.engines] == ["sdpa", "math"]
    assert [row.attention for row in pool.status().devices] == ["sdpa", "math"]
    assert pool.status().to_dict()["devices"][1]["attention"] == "math"
    # An unknown label is refused naming the labels, before any engine changes.
    with pytest.raises(EngineError, match=r"unknown engine 'cpu#3': one of cpu#1, cpu#2, or 'all'"):
        pool.set_attention("chunked", engine="cpu#3")
    assert [engine.attention_request for engine in pool.engines] == ["sdpa", "math"]
    # A refused strategy on one engine leaves both as they were.
    with pytest.raises(EngineError, match="bogus"):
        pool.set_attention("bogus", engine="cpu#1")
    assert [engine.attention_request for engine in pool.engines] == ["sdpa", "math"]
    # "all" (and no engine named) switches every engine again.
    assert pool.set_attention("chunked", engine="all") == "chunked"
    assert [engine.attention_request for engine in pool.engines] == ["chunked", "chunked"]
    assert pool.set_attention("sdpa") == "sdpa"
    assert [engine.attention_request for engine in pool.engines] == ["sdpa", "sdpa"]


def test_a_one_engine_switch_waits_for_that_engine_only(tmp_path):
    pool = cpu_pool(tmp_path)
    with pool.acquire(slot=pool.slots[0]):  # a job holds cpu#1
        done = threading.Thread(target=pool.set_attention, args=("math", "cpu#2"))
        done.start()
        done.join(10)
        assert not done.is_alive() and pool.engines[1].attention_request == "math"
        waiting = threading.Thread(target=pool.set_attention, args=("math", "cpu#1"))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and pool.engines[0].attention_request == "sdpa"  # not under the running job
    waiting.join(10)
    assert [engine.attention_request for engine in pool.engines] == ["math", "math"]


def test_the_panel_switches_the_chosen_engine_and_shows_each_engines_attention(tmp_path):
    from hidream_ui.ui.layout import build_demo
    from hidream_ui.ui.system_handlers import SystemHandlers

    pool = cpu_pool(tmp_path)
    handlers = SystemHandlers(pool)
    update, note, panel = handlers.change_attention("math", "cpu#1")
    assert update["value"] == "math" and "active on cpu#1" in note
    assert [engine.attention_request for engine in pool.engines] == ["math", "sdpa"]
    assert "cpu#1 math · cpu#2 sdpa" in panel and "attention sdpa" in panel
    update, note, _ = handlers.change_attention("chunked", "gpu#7")
    assert "unknown engine 'gpu#7'" in note.replace("&#x27;", "'")
    assert [engine.attention_request for engine in pool.engines] == ["math", "sdpa"]
    assert handlers.attention_target("cpu#2")[0]["value"] == "sdpa"
    # The Engine choice is there on a pool only.
    ids = {getattr(block, "elem_id", None) for block in build_demo(pool).blocks.values()}
    assert "hui-attention-engine" in ids
    single = build_demo(EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path)))
    assert "hui-attention-engine" not in {getattr(block, "elem_id", None) for block in single.blocks.values()}


@pytest.mark.slow
def test_set_attention_api_switches_one_engine_of_a_running_pool_app(tmp_path, tiny_cache):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from hidream_ui.bench import free_port
    from hidream_ui.cli.app import launch

    config = AppConfig(devices=("cpu", "cpu"), attention="sdpa", output_dir=tmp_path, port=free_port())
    demo, url = launch(config, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False)
        assert client.predict(name="math", engine="cpu#2", api_name="/set_attention") == "math"
        status = client.predict(api_name="/status")
        assert [(row["engine"], row["attention"]) for row in status["devices"]] == [
            ("cpu#1", "sdpa"),
            ("cpu#2", "math"),
        ]
        with pytest.raises(AppError, match="unknown engine 'npu:5'"):
            client.predict(name="math", engine="npu:5", api_name="/set_attention")
        assert client.predict(name="chunked", api_name="/set_attention") == "chunked"  # no engine: all
        rows = client.predict(api_name="/status")["devices"]
        assert [row["attention"] for row in rows] == ["chunked", "chunked"]
        client.close()
    finally:
        demo.close()


def test_pool_status_reads_each_engines_status_once_per_call(tmp_path, monkeypatch):
    """The panel's 2 s timer calls status(): one snapshot per engine, not a second for the first."""
    pool = EnginePool.for_config(AppConfig(devices=("cpu", "cpu"), output_dir=tmp_path), cores=2)
    calls = []
    for engine in pool.engines:
        real = engine.status
        monkeypatch.setattr(engine, "status", lambda real=real, engine=engine: calls.append(engine) or real())
    status = pool.status()
    assert len(status.devices) == 2
    assert [calls.count(engine) for engine in pool.engines] == [1, 1]
