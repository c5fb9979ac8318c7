"""--isq q4_k / q6_k: the K-quant quantizers (xinfer/loader/kquant.py) byte for byte against
llama.cpp's own C reference (`quantize_row_q4_K_ref`, `quantize_row_q6_K_ref` in ggml-quants.c),
compiled here from the llama.cpp that the llama-cpp-python sdist on PyPI vendors, for baseline
x86-64 (no FMA contraction: the C source's float32 operations as written)."""
import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tests.conftest import cache_dir
from xinfer.loader import isq, kquant

SDIST = "llama_cpp_python==0.3.36"
_STUB = """#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { abort(); }
size_t ggml_row_size(int type, long long ne) { abort(); }
const char *ggml_type_name(int type) { return "?"; }
size_t ggml_type_size(int type) { abort(); }
"""


@pytest.fixture(scope="module")
def reference():
    cache = Path(cache_dir()) / "ggml-quants-ref"
    so = cache / "ref.so"
    if not so.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler to build llama.cpp's reference quantizers; the quantizers' round trip "
                        "through gguf's dequantizer below still runs")
        cache.mkdir(parents=True, exist_ok=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              SDIST, "-d", str(cache)], capture_output=True, text=True)
        tars = list(cache.glob("llama_cpp_python-*.tar.gz"))
        if got.returncode or not tars:
            pytest.skip(f"could not download the {SDIST} sdist (llama.cpp's source) from PyPI, so there is no C "
                        f"reference to compare bytes with; the round trip below still runs: {got.stderr[-300:]}")
        with tarfile.open(tars[0]) as tf:
            keep = [m for m in tf.getmembers() if "/vendor/llama.cpp/ggml/" in m.name
                    and (m.name.endswith(".h") or m.name.endswith("/ggml-quants.c"))]
            tf.extractall(cache, members=keep, filter="data")
        ggml = next(cache.glob("llama_cpp_python-*/vendor/llama.cpp/ggml"))
        (cache / "stub.c").write_text(_STUB)
        tmp = cache / f"ref.so.tmp{os.getpid()}"
        subprocess.run([cc, "-O2", "-fPIC", "-shared", str(ggml / "src" / "ggml-quants.c"), str(cache / "stub.c"),
                        f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}", "-lm",
                        "-o", str(tmp)], check=True, capture_output=True)
        os.replace(tmp, so)
        tars[0].unlink()
    return ctypes.CDLL(str(so))


def _ref(lib, fn, x, nbytes):
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(x.size // 256 * nbytes, np.uint8)
    getattr(lib, fn)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.reshape(-1, nbytes)


def _hard(rng):
    """Super-blocks that reach the algorithms' branches: zero and constant sub-blocks, all-positive
    ones (min clamps to 0), outlier rows, tiny and huge magnitudes, heavy tails."""
    x = rng.standard_normal((600, 256)).astype(np.float32) * 0.02
    x[::7] *= 50
    x[3] = 0
    x[5, :16] = 0
    x[6, :32] = 0.37
    x[20:60] = np.abs(x[20:60])
    x[60:80, ::3] = 0
    x[80] = 1e-20
    x[81] *= 1e4
    x[100:200] = rng.standard_t(3, size=(100, 256)) * 0.05
    return x


@pytest.mark.parametrize("fmt,fn,nbytes", [("q4_k", "quantize_row_q4_K_ref", 144), ("q6_k", "quantize_row_q6_K_ref", 210)])
def test_kquant_bytes_equal_llama_cpp(reference, fmt, fn, nbytes, monkeypatch):
    x = _hard(np.random.default_rng(0))
    assert np.array_equal(getattr(kquant, fmt)(x), _ref(reference, fn, x, nbytes))
    wide = np.random.default_rng(1).standard_normal((7, 4096)).astype(np.float32)  # rows over several chunks
    monkeypatch.setattr(isq, "_CHUNK", 3 * 4096)
    assert np.array_equal(isq.quantize(torch.from_numpy(wide), fmt).numpy().reshape(-1, nbytes),
                          _ref(reference, fn, wide, nbytes))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_kquant_round_trip(fmt):
    """What gguf dequantizes from our bytes is close to the input (relative RMS error of 4- and
    6-bit quantization), and the fallback for rows that are not whole super-blocks."""
    x = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    raw = isq.quantize(torch.from_numpy(x), fmt).numpy()
    back = dequantize(raw, Q[fmt.upper()]).reshape(x.shape)
    rel = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    assert rel < {"q4_k": 0.12, "q6_k": 0.03}[fmt], rel
    assert isq.block_format(fmt, 512) == fmt and isq.block_format(fmt, 96) == {"q4_k": "q5_0", "q6_k": "q8_0"}[fmt]
