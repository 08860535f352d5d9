"""A CUDA graph captured while another thread of the process makes CUDA calls that are unsafe during a
capture (cudaMalloc / cudaFree; a server's other threads call CUDA while its graphs are captured):
common/engine/cuda_graph.capture_graph still captures, and the graph replays right. The control:
torch's default "global" capture mode fails under the same thread."""

import ctypes
import subprocess
import sys
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


def test_torchs_global_mode_does_not():
    # In a process of its own: a capture that failed leaves torch's CUDA generator in its capture state
    # ("Offset increment outside graph capture" at the next torch.randn of the process).
    code = (
        "import pytest, torch\n"
        "from tests.gpu.test_capture_beside_threads import capture_beside_a_busy_thread\n"
        "with pytest.MonkeyPatch.context() as mp:\n"
        "    try:\n"
        "        capture_beside_a_busy_thread(mp, 'global')\n"
        "    except (RuntimeError, torch.AcceleratorError) as e:\n"
        "        print('capture failed:', str(e).splitlines()[0])\n"
        "    else:\n"
        "        print('captured')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "capture failed:" in out.stdout, out.stdout + out.stderr[-2000:]
