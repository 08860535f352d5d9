"""A CUDA graph captured while another thread of the process makes CUDA calls that are unsafe during a
capture (cudaMalloc / cudaFree, as UCX's CUDA transports make while a NIXL agent starts beside the
model's graphs): common/engine/cuda_graph.capture_graph still captures, and the graph replays right.
The control: torch's default "global" capture mode fails under the same thread."""

import ctypes
import threading

import pytest
import torch

from pdserve.common.engine import cuda_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cudart() -> ctypes.CDLL:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    pytest.skip("no libcudart to load")


def capture_beside_a_busy_thread(monkeypatch, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(cuda_graph, "CAPTURE_MODE", mode)
    lib, stop, running = cudart(), threading.Event(), threading.Event()

    def allocate_and_free() -> None:
        torch.cuda.set_device(0)
        ptr = ctypes.c_void_p()
        while not stop.is_set():
            if lib.cudaMalloc(ctypes.byref(ptr), 1 << 20) == 0:
                lib.cudaFree(ptr)
            running.set()

    x = torch.randn(512, 512, device="cuda")

    def run() -> torch.Tensor:
        y = x
        for _ in range(200):  # long enough a capture for the thread's calls to fall inside it
            y = torch.tanh(y @ x)
        return y

    thread = threading.Thread(target=allocate_and_free, daemon=True)
    thread.start()
    assert running.wait(10)
    try:
        graph, out = cuda_graph.capture_graph(torch.cuda.Stream(), None, run)
    finally:
        stop.set()
        thread.join(10)
    x.copy_(torch.randn(512, 512, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    return out, run()


def test_a_capture_survives_another_threads_unsafe_calls(monkeypatch):
    out, expected = capture_beside_a_busy_thread(monkeypatch, cuda_graph.CAPTURE_MODE)
    torch.testing.assert_close(out, expected)


def test_torchs_global_mode_does_not(monkeypatch):
    with pytest.raises((RuntimeError, torch.AcceleratorError)):
        capture_beside_a_busy_thread(monkeypatch, "global")
    torch.cuda.synchronize()
