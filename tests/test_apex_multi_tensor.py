"""apex's multi-tensor tests, re-expressed for ampinit's ``amp_C``, ``apex_C`` and
``apex.multi_tensor_apply`` (``ampinit/apex/``).

apex's originals (tests/L0/run_amp/) are test_multi_tensor_scale.py, test_multi_tensor_axpby.py
(with its channels_last variant), test_multi_tensor_l2norm.py, test_multi_tensor_unscale_l2norm.py
and test_update_scale_hysteresis.py.  The values, the structure (size pairs around the chunk
boundaries, three appliers with different chunk sizes, a single pair of tensors and more than
110 tensors in one call, every fp32/fp16 in/out combination, in place only where the dtypes
match, inf/NaN planted at the first, last and a middle element) and the assertions are apex's;
the code is written anew, runs on the CPU, and on CUDA too where there is one.

What was reduced from apex's fuzz space, and why: this suite runs on 2 CPU cores, twice (on the
compiled kernels and on the torch fallback), and should stay under a minute.

- apex repeats every size pair 55 times (110 tensors per list).  Here the many-tensor case uses
  56 repeats (112 tensors, more than 110) for the pairs of up to 140k elements; the pairs that
  hold a tensor of 0.3-0.7 million elements ((7777*77, 555*555) and the large NHWC shapes) run
  with one repeat only: at 55 repeats each would be 20-80 million elements per list (up to
  ~300 MB per fp32 list), for the same kind of case the smaller pairs already cover.
- apex runs every case through all three appliers (chunk sizes 65536, 333, 33333).  ampinit's
  kernels chunk by themselves and ignore the chunk size, so the three appliers compute the
  same thing; every applier still runs every size pair, but the many-tensor repeat goes
  through one applier per case (rotating over the three), not all three.
- apex's hysteresis test draws up to 1000 extra iterations per phase from an unseeded RNG.  Here
  the extra iterations come from a seeded RNG, in [0, 300] (up to 1000 in two dedicated
  cases), and dedicated cases make sure that underflow to 0 and refused non-finite growth are
  always exercised (apex's fuzz hit them only by chance).
- Cheaper plumbing with the same values: the lists are built with one ``fill_`` per tensor
  (apex clones and casts an fp32 tensor), the planted inf/NaN cases reuse the lists of the clean
  call (restoring the planted element) instead of building new ones, outputs are compared on
  their smallest and largest elements, and the CPU ops run on one thread (see _one_cpu_thread).

Beyond apex: arg_to_check of axpby (apex's inf cases there are commented out), random values,
bf16, empty tensors, the applier's argument checks, the module surface, apex_C, and the names
under the alias.
"""

import copy
import importlib
import itertools
import math
import random
import struct
import sys

import pytest
import torch

import ampinit.optim
from ampinit import ops
from ampinit.apex import amp_C, apex_C
from ampinit.apex import multi_tensor_apply as mta
from ampinit.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

FP32, FP16 = torch.float32, torch.float16
CHUNK = 2048 * 32  # 65536, apex's default chunk size

# apex's size pairs: just below, at and above 65536 and the appliers' chunk sizes.
SIZE_PAIRS = [(7777 * 77, 555 * 555), (777, 555), (555, CHUNK + 1), (CHUNK + 1, 555), (555, CHUNK), (CHUNK, 555),
              (33333, 555), (555, 33333)]
NHWC_PAIRS = [((7, 77, 7, 77), (5, 55, 5, 55)), ((1, 1, 777, 1), (1, 1, 555, 1)),
              ((5, 47, 5, 55), (1, 1, 1, CHUNK + 1)), ((1, 1, 1, CHUNK + 1), (55, 47, 5, 55)),
              ((555, 1, 1, 1), (32, 8, 32, 8)), ((32, 8, 32, 8), (55, 47, 5, 55)),
              ((1, 1, 33333, 1), (55, 47, 55, 5)), ((55, 47, 55, 5), (1, 1, 33333, 1))]
APPLIERS = [MultiTensorApply(CHUNK), MultiTensorApply(333), MultiTensorApply(33333)]
MANY = 56  # 2 * 56 = 112 tensors per list, more than 110
MANY_LIMIT = 140_000  # the many-tensor repeat runs for pairs up to this many elements


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """Run this module's CPU ops on one thread.

    The fuzz is thousands of ops on tensors just over torch's parallel grain size, each an
    OpenMP parallel region.  On a shared 2-core machine a region waits (spinning) whenever the
    other core is busy elsewhere, which made this file 5-10x slower and its runtime
    unpredictable (60 s -> 200+ s).  One thread changes no result; the threaded path of the
    kernels is exercised once, on purpose, by test_multi_tensor_ops_threaded.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _numel(size):
    return math.prod(size) if isinstance(size, tuple) else size


def _runs(sizea, sizeb, case_index):
    """(applier, repeat) pairs for one case: every applier with one repeat, and the
    many-tensor repeat through one applier (rotating with the case) where the pair is small."""
    runs = [(applier, 1) for applier in APPLIERS]
    if _numel(sizea) + _numel(sizeb) <= MANY_LIMIT:
        runs.append((APPLIERS[case_index % len(APPLIERS)], MANY))
    return runs


def _on_kernels(device):
    """Whether ampinit.ops runs its compiled kernels for tensors on ``device``."""
    return ops.backend(torch.device(device))[0] != "torch"


def _flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


def _full(size, value, dtype, device, nhwc=False):
    """A tensor of ``value`` (apex builds its lists by cloning and casting one fp32 tensor; this
    builds each directly, with the same values, to keep the suite fast)."""
    layout = torch.channels_last if nhwc else torch.contiguous_format
    return torch.empty(size, dtype=dtype, device=device, memory_format=layout).fill_(value)


def _assert_all(tensors, value, msg):
    """Every element of every tensor is close to ``value`` (apex: ``allclose`` with the reference
    in the tensors' dtype), checked on each tensor's smallest and largest element (NaN propagates)."""
    for dtype in {t.dtype for t in tensors}:
        extremes = torch.stack([torch.stack(torch.aminmax(t)) for t in tensors if t.dtype == dtype and t.numel()])
        assert torch.allclose(extremes, torch.full_like(extremes, value)), msg


def _dtype_cases(*names):
    return [pytest.param(*types, id="-".join(str(t).replace("torch.", "") for t in types)) for types in names]


# -- multi_tensor_scale (apex: test_multi_tensor_scale.py) -------------------------------------

SCALE = 4.0
SCALE_TYPES = [(i, o, inplace) for i in (FP32, FP16) for o in (FP32, FP16) for inplace in (False, True)
               if not inplace or i is o]


def _scale_lists(sizea, sizeb, repeat, in_type, out_type, inplace, device):
    outs = []
    for _ in range(repeat):
        outs += [_full(sizea, SCALE, out_type, device), _full(sizeb, SCALE, out_type, device)]
    ins = outs if inplace else [_full(out.shape, SCALE, in_type, device) for out in outs]
    return ins, outs


def _downscale_and_find_infs(sizea, sizeb, applier, repeat, in_type, out_type, inplace, device):
    flag = _flag(device)
    ins, outs = _scale_lists(sizea, sizeb, repeat, in_type, out_type, inplace, device)
    applier(amp_C.multi_tensor_scale, flag, [ins, outs], 1.0 / SCALE)
    msg = f"{sizea} {sizeb} {applier} x{repeat} {in_type} -> {out_type} inplace={inplace}"
    _assert_all(outs, 1.0, msg)
    assert flag.item() == 0, msg
    # apex's find_inf: after a clean call, zero the flag, plant a value in the inputs, call again.
    # (apex builds fresh lists for each plant; here the planted element is restored instead.)
    for t, index, value in ((0, 0, float("nan")),                          # first tensor, first element
                            (2 * repeat - 1, sizeb - 1, float("inf")),      # last tensor, last element
                            (2 * (repeat // 2), sizea // 2, float("inf"))):  # an "a" tensor, middle element
        flag.zero_()
        ins[t][index] = value
        applier(amp_C.multi_tensor_scale, flag, [ins, outs], 1.0 / SCALE)
        where = f"{msg} [{t}][{index}]={value}"
        assert flag.item() != 0, where
        # The op propagates: the non-finite value is written to the output.
        assert not torch.isfinite(outs[t][index]).item(), where
        ins[t][index] = SCALE


@pytest.mark.parametrize("in_type,out_type,inplace", _dtype_cases(*SCALE_TYPES))
@pytest.mark.parametrize("sizea,sizeb", SIZE_PAIRS)
def test_multi_tensor_scale_fuzz(device, sizea, sizeb, in_type, out_type, inplace):
    case = SIZE_PAIRS.index((sizea, sizeb)) + SCALE_TYPES.index((in_type, out_type, inplace))
    for applier, repeat in _runs(sizea, sizeb, case):
        _downscale_and_find_infs(sizea, sizeb, applier, repeat, in_type, out_type, inplace, device)


def test_multi_tensor_scale_edges(device):
    # A scale of 1.0 is how Megatron copies lists (model <-> main params), bf16 included.
    flag = _flag(device)
    src = [torch.randn(1000, device=device), torch.randn(3, 7, device=device).to(torch.bfloat16)]
    dst = [torch.empty(1000, dtype=torch.bfloat16, device=device), torch.empty(3, 7, device=device)]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 1.0)
    assert torch.equal(dst[0], src[0].to(torch.bfloat16)) and torch.equal(dst[1], src[1].float())
    x = torch.randn(4097, device=device)
    out = torch.empty(4097, dtype=FP16, device=device)
    assert flag.item() == 0
    # The flag is only ever set, never cleared, and a set flag does not stop the op.
    flag.fill_(1)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[x], [out]], 2.0)
    assert flag.item() == 1 and torch.equal(out, (x * 2).to(FP16))
    # The scale may also be a 1-element tensor on the device (no sync to read it).
    flag.zero_()
    halved = x * 0.5
    amp_C.multi_tensor_scale(CHUNK, flag, [[x], [x]], torch.tensor([0.5], device=device))
    assert flag.item() == 0 and torch.equal(x, halved)
    # Documented difference: ampinit's kernels check the scaled value, so a finite input whose
    # product overflows float32 is flagged (apex, and torch's unscale op that the fallback uses,
    # check the input only).  The overflowed value is written either way.
    big = torch.full((5,), 3e38, device=device)
    out = big.clone()
    amp_C.multi_tensor_scale(CHUNK, flag, [[big], [out]], 2.0)
    assert torch.isinf(out).all()
    if _on_kernels(device):
        assert flag.item() == 1


def test_multi_tensor_scale_narrowing_rounds_once(device):
    # apex (and ampinit's kernels): out = fp16(fp32(in) * scale), rounded once.
    flag = _flag(device)
    x = torch.randn(4097, generator=torch.Generator().manual_seed(3)).to(device)
    out = torch.empty(4097, dtype=FP16, device=device)
    amp_C.multi_tensor_scale(CHUNK, flag, [[x], [out]], 0.3)
    assert torch.equal(out, (x * torch.tensor(0.3, dtype=FP32)).to(FP16))
    # 1e5 / 4 fits in float16 although 1e5 does not: nothing to flag.
    x = torch.tensor([1e5, -6e4, 3.0], device=device)
    out = torch.empty(3, dtype=FP16, device=device)
    amp_C.multi_tensor_scale(CHUNK, flag, [[x], [out]], 0.25)
    assert torch.equal(out, (x * 0.25).to(FP16))
    assert flag.item() == 0


# -- multi_tensor_axpby (apex: test_multi_tensor_axpby.py) -------------------------------------

A, B, XVAL, YVAL = 2.0, 8.0, 4.0, 16.0  # 2 * 4 + 8 * 16 = 136
AXPBY_TYPES = [(x, y, o, inplace) for x in (FP32, FP16) for y in (FP32, FP16) for o in (FP32, FP16)
               for inplace in (False, True) if not inplace or y is o]


def _axpby(sizea, sizeb, applier, repeat, x_type, y_type, out_type, inplace, nhwc, device):
    flag = _flag(device)
    sizea = sizea if isinstance(sizea, tuple) else (sizea,)
    sizeb = sizeb if isinstance(sizeb, tuple) else (sizeb,)
    # apex: y = 16 (cast from ones), x = y cast to x_type * 4/16, out = y cast to out_type * 3.
    ys = []
    for _ in range(repeat):
        ys += [_full(sizea, YVAL, y_type, device, nhwc), _full(sizeb, YVAL, y_type, device, nhwc)]
    xs = [_full(y.shape, XVAL, x_type, device, nhwc) for y in ys]
    outs = ys if inplace else [_full(y.shape, 3.0 * YVAL, out_type, device, nhwc) for y in ys]
    applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], A, B, -1)
    msg = f"{sizea} {sizeb} {applier} x{repeat} {x_type} {y_type} -> {out_type} inplace={inplace} nhwc={nhwc}"
    _assert_all(outs, 136.0, msg)
    assert flag.item() == 0, msg
    if nhwc:
        assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs), msg


@pytest.mark.parametrize("x_type,y_type,out_type,inplace", _dtype_cases(*AXPBY_TYPES))
@pytest.mark.parametrize("sizea,sizeb", SIZE_PAIRS)
def test_multi_tensor_axpby_fuzz(device, sizea, sizeb, x_type, y_type, out_type, inplace):
    case = SIZE_PAIRS.index((sizea, sizeb)) + AXPBY_TYPES.index((x_type, y_type, out_type, inplace))
    for applier, repeat in _runs(sizea, sizeb, case):
        _axpby(sizea, sizeb, applier, repeat, x_type, y_type, out_type, inplace, False, device)


@pytest.mark.parametrize("x_type,y_type,out_type,inplace", _dtype_cases(*AXPBY_TYPES))
@pytest.mark.parametrize("sizea,sizeb", NHWC_PAIRS)
def test_multi_tensor_axpby_fuzz_nhwc(device, sizea, sizeb, x_type, y_type, out_type, inplace):
    case = NHWC_PAIRS.index((sizea, sizeb)) + AXPBY_TYPES.index((x_type, y_type, out_type, inplace))
    for applier, repeat in _runs(sizea, sizeb, case):
        _axpby(sizea, sizeb, applier, repeat, x_type, y_type, out_type, inplace, True, device)


@pytest.mark.parametrize("layout", ["apart", "out_is_y", "out_is_x"])
@pytest.mark.parametrize("planted_in", ["x", "y"])
def test_multi_tensor_axpby_arg_to_check(device, layout, planted_in):
    # apex's axpby test has its inf cases commented out; this checks arg_to_check itself.
    for arg_to_check, value, (t, index) in itertools.product((-1, 0, 1), (float("inf"), float("nan")),
                                                             ((0, 0), (2, 554), (1, 16))):
        xs = [torch.full((n,), XVAL, device=device) for n in (33, 777, 555)]
        ys = [torch.full((n,), YVAL, dtype=FP16, device=device) for n in (33, 777, 555)]
        outs = {"apart": [torch.zeros(n, device=device) for n in (33, 777, 555)], "out_is_y": ys,
                "out_is_x": xs}[layout]
        (xs if planted_in == "x" else ys)[t][index] = value
        flag = _flag(device)
        amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, outs], A, B, arg_to_check)
        checked = arg_to_check == -1 or (arg_to_check == 0) == (planted_in == "x")
        assert flag.item() == int(checked), (arg_to_check, value, t, index)
        assert not torch.isfinite(outs[t][index]).item()
        others = [o for i, o in enumerate(outs) if i != t]
        _assert_all(others, 136.0, "untouched tensors")


@pytest.mark.parametrize("layout", ["apart", "apart_fp32", "out_is_y", "out_is_x"])
def test_multi_tensor_axpby_values(device, layout):
    # Random values: out = a * x + b * y computed in float32, cast to out's dtype, in every layout.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g).to(device)
    y = torch.randn(5000, generator=g).to(device, FP16)
    expected = 0.7 * x + (-1.3) * y.float()
    out = {"apart": torch.empty(5000, dtype=FP16, device=device), "apart_fp32": torch.empty(5000, device=device),
           "out_is_y": y, "out_is_x": x}[layout]
    flag = _flag(device)
    amp_C.multi_tensor_axpby(CHUNK, flag, [[x], [y], [out]], 0.7, -1.3, -1)
    torch.testing.assert_close(out, expected.to(out.dtype))
    assert flag.item() == 0


# -- multi_tensor_l2norm / multi_tensor_unscale_l2norm (apex: test_multi_tensor_l2norm.py, ---
# -- test_multi_tensor_unscale_l2norm.py) -------------------------------------------------------

PER_TENSOR = [False, True, None]


def _norm_lists(sizea, sizeb, repeat, in_type, device):
    tensors = []
    for _ in range(repeat):
        tensors += [_full(sizea, 4.0, in_type, device), _full(sizeb, 4.0, in_type, device)]
    return tensors


def _check_norms(norm, per, sizea, sizeb, repeat, per_tensor, factor, device, msg):
    # The norm of (sizea + sizeb) * repeat fours, each times factor.
    reference = torch.tensor(4.0 * factor * math.sqrt((sizea + sizeb) * repeat), dtype=FP32, device=device)
    assert norm.dtype == FP32 and norm.shape == (1,) and norm.device == reference.device, msg
    torch.testing.assert_close(norm, reference.broadcast_to(norm.shape), msg=msg)
    if per_tensor:
        pair = torch.tensor([4.0 * factor * math.sqrt(sizea), 4.0 * factor * math.sqrt(sizeb)], dtype=FP32,
                            device=device)
        assert per.shape == (2 * repeat,), msg
        torch.testing.assert_close(per.view(-1, 2), pair.broadcast_to((repeat, 2)), msg=msg)
    else:
        assert per.dtype == FP32 and per.numel() == 0, msg


@pytest.mark.parametrize("per_tensor", PER_TENSOR)
@pytest.mark.parametrize("in_type", [FP32, FP16])
@pytest.mark.parametrize("sizea,sizeb", SIZE_PAIRS)
def test_multi_tensor_l2norm_fuzz(device, sizea, sizeb, in_type, per_tensor):
    case = SIZE_PAIRS.index((sizea, sizeb)) + PER_TENSOR.index(per_tensor)
    for applier, repeat in _runs(sizea, sizeb, case):
        flag = _flag(device)
        tensors = _norm_lists(sizea, sizeb, repeat, in_type, device)
        norm, per = applier(amp_C.multi_tensor_l2norm, flag, [tensors], per_tensor)
        msg = f"{sizea} {sizeb} {applier} x{repeat} {in_type} per_tensor={per_tensor}"
        _check_norms(norm, per, sizea, sizeb, repeat, per_tensor, 1.0, device, msg)
        assert flag.item() == 0, msg


@pytest.mark.parametrize("per_tensor", PER_TENSOR)
@pytest.mark.parametrize("in_type", [FP32, FP16])
@pytest.mark.parametrize("sizea,sizeb", SIZE_PAIRS)
def test_multi_tensor_unscale_l2norm_fuzz(device, sizea, sizeb, in_type, per_tensor):
    case = SIZE_PAIRS.index((sizea, sizeb)) + PER_TENSOR.index(per_tensor)
    inv_scale = torch.tensor([0.5], dtype=FP32, device=device)
    for applier, repeat in _runs(sizea, sizeb, case):
        flag = _flag(device)
        tensors = _norm_lists(sizea, sizeb, repeat, in_type, device)
        norm, per = applier(amp_C.multi_tensor_unscale_l2norm, flag, [tensors], inv_scale, per_tensor)
        msg = f"{sizea} {sizeb} {applier} x{repeat} {in_type} per_tensor={per_tensor}"
        _check_norms(norm, per, sizea, sizeb, repeat, per_tensor, 0.5, device, msg)
        assert flag.item() == 0, msg
        _assert_all(tensors, 4.0, msg + ": the inputs were modified")


@pytest.mark.parametrize("op", ["l2norm", "unscale_l2norm"])
def test_multi_tensor_l2norm_nonfinite_and_values(device, op):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g).to(device, dtype) for n, dtype in ((1, FP32), (4097, FP16), (70000, FP32),
                                                                             (0, FP32), (333, torch.bfloat16))]
    extra = (torch.tensor([0.25], device=device),) if op == "unscale_l2norm" else ()
    factor = 0.25 if extra else 1.0
    function = getattr(amp_C, f"multi_tensor_{op}")
    flag = _flag(device)
    norm, per = multi_tensor_applier(function, flag, [tensors], *extra, True)
    expected = torch.stack([t.double().norm() for t in tensors]) * factor
    torch.testing.assert_close(per, expected.float())
    torch.testing.assert_close(norm, expected.norm().float().reshape(1))
    assert flag.item() == 0
    for t, index, value in ((0, 0, float("nan")), (2, 69999, float("inf")), (1, 2048, float("-inf"))):
        flag.zero_()
        bad = [x.clone() for x in tensors]
        bad[t][index] = value
        norm, per = multi_tensor_applier(function, flag, [bad], *extra, True)
        assert flag.item() == 1 and not torch.isfinite(norm).item() and not torch.isfinite(per[t]).item()


def test_multi_tensor_ops_threaded(device):
    # The module runs on one CPU thread (see _one_cpu_thread); here the ops run once with two
    # threads, where there are two cores, and must give exactly the one-thread results.
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, generator=g).to(device) for n in [CHUNK + 1, 555, 33333] * 40]
    ys = [torch.randn(x.shape, generator=g).to(device, FP16) for x in xs]

    def run():
        flag = _flag(device)
        scaled = [torch.empty(x.shape, dtype=FP16, device=device) for x in xs]
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [xs, scaled], 0.3)
        summed = [torch.empty(x.shape, dtype=FP16, device=device) for x in xs]
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, summed], 0.7, -1.3, -1)
        norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs + ys], True)
        return scaled, summed, norm, per, flag

    one = run()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert torch.equal(u, v)


# -- update_scale_hysteresis (apex: test_update_scale_hysteresis.py) ---------------------------

TINY = torch.finfo(torch.float32).tiny


def _f32(value):
    """``value`` rounded to float32 (to nearest even), as a Python float; inf past the range."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _bits(value):
    return struct.unpack("<I", struct.pack("<f", value))[0]


class HysteresisReference:
    """apex's update_scale_hysteresis rule on Python scalars, one call at a time."""

    def __init__(self, scale, hysteresis):
        self.scale, self.growth_tracker, self.hysteresis_tracker = _f32(scale), 0, hysteresis

    def step(self, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis):
        if found_inf > 0:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.growth_tracker = 0
                return
        if found_inf != 0:
            backed_off = _f32(self.scale * backoff_factor)  # a double product, stored as float
            self.scale = 0.0 if abs(backed_off) < TINY else backed_off  # flushed like fast math
            self.growth_tracker = 0
        elif self.growth_tracker + 1 == growth_interval:
            grown = _f32(self.scale * growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
        if found_inf <= 0:
            self.hysteresis_tracker = hysteresis


def _apex_closed_form(scale, factor, times):
    """apex's expectation: ``times`` multiplications, each kept only while the result stays a
    finite normal float32 (below that the scale is 0; past FLT_MAX the growth is refused)."""
    for _ in range(times):
        candidate = scale * factor
        if TINY <= candidate <= torch.finfo(torch.float32).max:
            scale = candidate
        elif candidate < TINY:
            scale = 0.0
    return scale


def _run_hysteresis(device, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, extra_inf,
                    extra_clean, power_of_two=True):
    scale = torch.tensor([init_scale], dtype=FP32, device=device)
    growth_tracker = torch.tensor([0], dtype=torch.int32, device=device)
    hysteresis_tracker = torch.tensor([hysteresis], dtype=torch.int32, device=device)
    found_inf = torch.tensor([1.0], dtype=FP32, device=device)
    reference = HysteresisReference(init_scale, hysteresis)
    args = (growth_factor, backoff_factor, growth_interval, hysteresis)

    def call(count, found):
        found_inf.fill_(found)
        for _ in range(count):
            result = amp_C.update_scale_hysteresis(scale, growth_tracker, hysteresis_tracker, found_inf, *args)
            assert result is scale
            reference.step(found, *args)
            state = (_bits(scale.item()), growth_tracker.item(), hysteresis_tracker.item())
            assert state == (_bits(reference.scale), reference.growth_tracker, reference.hysteresis_tracker), \
                (init_scale, args, found, scale.item(), reference.scale)

    call(hysteresis - 1, 1.0)              # infs within the hysteresis budget: no change
    assert scale.item() == _f32(init_scale)
    call(growth_interval - 1, 0.0)         # clean steps short of the growth interval: no change
    assert scale.item() == _f32(init_scale)
    before = scale.item()
    call(hysteresis + extra_inf, 1.0)      # the budget is spent: every further inf backs off
    if power_of_two:
        assert scale.item() == _apex_closed_form(before, backoff_factor, 1 + extra_inf)
    before = scale.item()
    call(growth_interval + extra_clean, 0.0)  # clean again: a growth every growth_interval steps
    if power_of_two:
        assert scale.item() == _apex_closed_form(before, growth_factor, 1 + extra_clean // growth_interval)
    return scale.item()


HYSTERESIS_GRID = list(itertools.product([1, 1024, 65536], [1.0, 2.0, 4.0], [0.5, 0.25], [10, 100], [10, 100]))


@pytest.mark.parametrize("init_scale,growth_factor,backoff_factor,growth_interval,hysteresis", HYSTERESIS_GRID)
def test_update_scale_hysteresis_fuzz(device, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
    rng = random.Random(HYSTERESIS_GRID.index((init_scale, growth_factor, backoff_factor, growth_interval,
                                               hysteresis)))
    _run_hysteresis(device, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                    rng.randint(0, 300), rng.randint(0, 300))


def test_update_scale_hysteresis_underflow_and_refused_growth(device):
    # 1 * 0.5**126 is the smallest normal float32; one more backoff is subnormal and becomes 0,
    # and 0 never grows back.
    assert _run_hysteresis(device, 1.0, 2.0, 0.5, 10, 10, 126, 1000) == 0.0
    # Starting at 2**127: one backoff to 2**126, one growth back to 2**127, then every growth
    # (to 2**128 = inf) is refused and the scale stays.
    assert _run_hysteresis(device, 2.0 ** 127, 2.0, 0.5, 10, 3, 0, 1000) == 2.0 ** 127
    # The same from a random start, with apex's full range of extra iterations.
    rng = random.Random(12345)
    _run_hysteresis(device, 65536, 4.0, 0.25, 10, 10, rng.randint(0, 1000), rng.randint(0, 1000))


def test_update_scale_hysteresis_rounding(device):
    # Factors that are not powers of two: the product is taken in double and rounded to float32
    # once (a float32 product of float32(0.3) would differ), compared bitwise at every step.
    _run_hysteresis(device, 65536.0, 1.7, 0.3, 3, 4, 90, 400, power_of_two=False)
    _run_hysteresis(device, 3.0e38, 1.0001, 0.999, 2, 2, 50, 300, power_of_two=False)


def test_update_scale_hysteresis_validation(device):
    scale = torch.tensor([1.0], device=device)
    ok = torch.tensor([0], dtype=torch.int32, device=device)
    found = torch.tensor([0.0], device=device)
    with pytest.raises(TypeError, match="current_scale"):
        amp_C.update_scale_hysteresis(scale.double(), ok, ok.clone(), found, 2.0, 0.5, 10, 2)
    with pytest.raises(TypeError, match="growth_tracker"):
        amp_C.update_scale_hysteresis(scale, ok.float(), ok.clone(), found, 2.0, 0.5, 10, 2)
    with pytest.raises(TypeError, match="found_inf"):
        amp_C.update_scale_hysteresis(scale, ok, ok.clone(), torch.zeros(2, device=device), 2.0, 0.5, 10, 2)


# -- the applier, the module surface, apex_C ---------------------------------------------------

def test_multi_tensor_applier_surface():
    assert MultiTensorApply.available is True
    assert multi_tensor_applier.chunk_size == 2048 * 32
    multi_tensor_applier.check_avail()
    seen = []

    def op(chunk_size, noop_flag, tensor_lists, *args):
        seen.append((chunk_size, noop_flag, tensor_lists, args))
        return "result"

    flag = _flag("cpu")
    lists = [[torch.ones(3)], [torch.ones(3)]]
    assert MultiTensorApply(333)(op, flag, lists, 1.5, "x") == "result"
    assert seen == [(333, flag, lists, (1.5, "x"))]


def test_multi_tensor_applier_validation():
    flag = _flag("cpu")
    x, y = torch.ones(4), torch.ones(5)
    scale = amp_C.multi_tensor_scale
    cases = [
        (ValueError, "equally long", lambda: multi_tensor_applier(scale, flag, [[x, x], [x]], 1.0)),
        (ValueError, "first tensor list is empty", lambda: multi_tensor_applier(scale, flag, [[], []], 1.0)),
        (ValueError, "different numbers of elements", lambda: multi_tensor_applier(scale, flag, [[x], [y]], 1.0)),
        (ValueError, "one device", lambda: multi_tensor_applier(scale, flag, [[x], [torch.ones(4, device="meta")]],
                                                                1.0)),
        (ValueError, "noop_flag is on", lambda: amp_C.multi_tensor_scale(CHUNK, flag.to("meta"), [[x], [x]], 1.0)),
        (ValueError, "expected 2 tensor list", lambda: multi_tensor_applier(scale, flag, [[x]], 1.0)),
        (ValueError, "expected 3 tensor list", lambda: amp_C.multi_tensor_axpby(CHUNK, flag, [[x], [x]], 1., 1., -1)),
        (TypeError, "list of lists", lambda: multi_tensor_applier(scale, flag, x, 1.0)),
        (TypeError, "must be a list of tensors", lambda: multi_tensor_applier(scale, flag, [x, x], 1.0)),
        (TypeError, "not a tensor", lambda: multi_tensor_applier(scale, flag, [[x], [3.0]], 1.0)),
        (TypeError, "noop_flag must be a tensor", lambda: multi_tensor_applier(scale, 0, [[x], [x]], 1.0)),
        (ValueError, "arg_to_check", lambda: amp_C.multi_tensor_axpby(CHUNK, flag, [[x], [x], [x]], 1., 1., 2)),
        (TypeError, "floating-point", lambda: amp_C.multi_tensor_l2norm(CHUNK, flag, [[x.long()]])),
        (TypeError, "only dense", lambda: amp_C.multi_tensor_scale(CHUNK, flag, [[x.to_sparse()], [x]], 1.0)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    # A foreign op through the applier gets the launcher's checks too.
    with pytest.raises(ValueError, match="different numbers of elements"):
        multi_tensor_applier(lambda *args: None, flag, [[x], [y]])
    assert flag.item() == 0


def test_amp_C_surface():
    for name in ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_unscale_l2norm",
                 "update_scale_hysteresis", "multi_tensor_adam"):
        assert callable(getattr(amp_C, name))
    replacements = {"multi_tensor_adam_capturable": "FusedAdam", "multi_tensor_sgd": "FusedSGD",
                    "multi_tensor_lamb": "FusedLAMB",
                    "multi_tensor_novograd": "FusedNovoGrad", "multi_tensor_lamb_mp": "FusedLAMB",
                    "multi_tensor_adagrad": "Adagrad", "multi_tensor_l2norm_mp": "multi_tensor_l2norm"}
    for name, replacement in replacements.items():
        assert not hasattr(amp_C, name)
        with pytest.raises(AttributeError, match=replacement):
            getattr(amp_C, name)
    with pytest.raises(AttributeError, match="no attribute 'not_an_op'"):
        amp_C.not_an_op  # noqa: B018


def test_apex_C_flatten_unflatten(device):
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(3, 4, generator=g).to(device), torch.randn(4, 5, generator=g).to(device).t(),
               torch.randn(2, 3, 4, 5, generator=g).to(device).to(memory_format=torch.channels_last),
               torch.randn(6, 4, generator=g).to(device)[:, 1:3], torch.empty(0, 3, device=device),
               torch.randn((), generator=g).to(device)]
    flat = apex_C.flatten(tensors)
    assert flat.dim() == 1 and flat.is_contiguous()
    assert torch.equal(flat, _flatten_dense_tensors(tensors))
    views = apex_C.unflatten(flat, tensors)
    assert isinstance(views, list)
    expected = _unflatten_dense_tensors(flat, tensors)
    for view, reference, like in zip(views, expected, tensors):
        assert view.shape == like.shape and torch.equal(view, reference) and torch.equal(view, like)
    flat.mul_(2)  # the non-empty results are views into flat
    assert all(torch.equal(view, like * 2) for view, like in zip(views, tensors))
    single = torch.randn(7, device=device)
    assert apex_C.flatten([single]).data_ptr() == single.data_ptr()
    with pytest.raises(ValueError):
        apex_C.flatten([])
    with pytest.raises(ValueError):
        apex_C.unflatten(torch.zeros(3, device=device), [torch.zeros(4, device=device)])


# -- the same calls under apex's names ---------------------------------------------------------

def _apex_era_calls(amp_C_module, apex_C_module, applier):
    """The calls apex-era scripts make (Megatron, NeMo, NVIDIA's BERT), through the given names."""
    flag = torch.zeros(1, dtype=torch.int32)
    grads = [torch.full((n,), 4.0) for n in (555, CHUNK + 1)]
    main = [torch.empty(n) for n in (555, CHUNK + 1)]
    applier(amp_C_module.multi_tensor_scale, flag, [grads, main], 1.0)            # Megatron's list copy
    assert all(torch.equal(m, g) for m, g in zip(main, grads))
    amp_C_module.multi_tensor_scale(CHUNK, flag, [main, main], 1.0 / 4.0)        # BERT's direct call
    _assert_all(main, 1.0, "scale")
    norm, _ = applier(amp_C_module.multi_tensor_l2norm, flag, [grads], False)   # Megatron's clip_grads
    torch.testing.assert_close(norm, torch.tensor([4.0 * math.sqrt(555 + CHUNK + 1)]))
    norm, per = applier(amp_C_module.multi_tensor_unscale_l2norm, flag, [grads], torch.tensor([0.5]), True)
    torch.testing.assert_close(per, torch.tensor([2.0 * math.sqrt(555), 2.0 * math.sqrt(CHUNK + 1)]))
    out = [torch.empty(n, dtype=FP16) for n in (555, CHUNK + 1)]
    applier(amp_C_module.multi_tensor_axpby, flag, [[g / 4 * XVAL for g in grads], [g / 4 * YVAL for g in grads], out],
            A, B, 0)
    _assert_all(out, 136.0, "axpby")
    assert flag.item() == 0
    scale, growth, hyst = torch.tensor([65536.0]), torch.tensor([0], dtype=torch.int32), torch.tensor([2],
                                                                                                      dtype=torch.int32)
    found = torch.tensor([1.0])
    for expected in (65536.0, 32768.0, 16384.0):                                  # NeMo's GradScaler
        amp_C_module.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 1000, 2)
        assert scale.item() == expected
    flat = apex_C_module.flatten(grads)
    assert [v.shape for v in apex_C_module.unflatten(flat, grads)] == [g.shape for g in grads]


def test_apex_names_resolve_to_these_modules(monkeypatch):
    # The part of the alias this file owns: apex's module names point here.  Put them in
    # sys.modules as the alias does (without the rest of it), and import them by those names.
    from ampinit.apex import ALIASED
    assert ALIASED["amp_C"] == "ampinit.apex.amp_C" and ALIASED["apex_C"] == "ampinit.apex.apex_C"
    assert ALIASED["apex.multi_tensor_apply"] == "ampinit.apex.multi_tensor_apply"
    import ampinit.apex as apex_package
    monkeypatch.setitem(sys.modules, "amp_C", amp_C)
    monkeypatch.setitem(sys.modules, "apex_C", apex_C)
    monkeypatch.setitem(sys.modules, "apex", apex_package)
    monkeypatch.setitem(sys.modules, "apex.multi_tensor_apply", mta)
    aliased_amp_C = importlib.import_module("amp_C")
    aliased_apex_C = importlib.import_module("apex_C")
    from apex.multi_tensor_apply import multi_tensor_applier as aliased_applier
    assert aliased_amp_C is amp_C and aliased_applier is multi_tensor_applier
    _apex_era_calls(aliased_amp_C, aliased_apex_C, aliased_applier)


def _alias_prerequisites():
    """Why the full alias cannot be installed in this tree yet (None when it can)."""
    for name in ("ampinit.apex.parallel", "ampinit.apex.optimizers", "ampinit.apex.fp16_utils"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            return f"install_apex_alias needs {name}, which is not in this tree yet ({error})"
    return None


@pytest.fixture
def apex_alias():
    import ampinit
    reason = _alias_prerequisites()
    if reason is not None:
        pytest.skip(reason)
    ampinit.install_apex_alias()
    try:
        yield
    finally:
        ampinit.uninstall_apex_alias()


def test_install_apex_alias_runs_the_same_calls(apex_alias):
    import amp_C as alias_amp_C
    import apex_C as alias_apex_C
    from apex.multi_tensor_apply import MultiTensorApply as AliasApply
    from apex.multi_tensor_apply import multi_tensor_applier as alias_applier
    assert alias_amp_C is amp_C and alias_apex_C is apex_C and AliasApply is MultiTensorApply
    import apex
    assert apex.multi_tensor_apply.multi_tensor_applier is multi_tensor_applier
    _apex_era_calls(alias_amp_C, alias_apex_C, alias_applier)


# -- no host sync (CUDA only: the CPU has nothing to synchronise with) --------------------------

def test_no_host_sync(device):
    if device != "cuda":
        pytest.skip("torch's sync debug mode watches CUDA synchronisation only")
    flag = _flag(device)
    xs = [torch.full((n,), 4.0, device=device) for n in (555, CHUNK + 1)]
    outs = [torch.empty(n, dtype=FP16, device=device) for n in (555, CHUNK + 1)]
    inv_scale = torch.tensor([0.5], device=device)
    scale = torch.tensor([1024.0], device=device)
    growth, hyst = (torch.tensor([0], dtype=torch.int32, device=device) for _ in range(2))
    found = torch.tensor([1.0], device=device)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [xs, outs], 0.25)
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, outs, outs], 2.0, 8.0, -1)
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, xs, outs], 2.0, 8.0, -1)
        multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs], True)
        multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, flag, [xs], inv_scale, True)
        amp_C.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 10, 2)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert flag.item() == 0


# -- amp_C.multi_tensor_adam, and optimizers written against apex's FusedAdam that call it -----------

def _adam_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _adam_grads(model, step):
    gen = torch.Generator().manual_seed(step)
    model.zero_grad()
    model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()


@pytest.mark.parametrize("mode", [0, 1], ids=["adam-l2", "adamw"])
def test_multi_tensor_adam_matches_torch_adam(mode):
    """apex's op through the applier, steps 1..10, against torch.optim.Adam (mode 0) / AdamW (1)."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ref = _adam_model()
    ref_opt = (torch.optim.AdamW if mode else torch.optim.Adam)(ref.parameters(), **hyper)
    model = _adam_model()
    params = list(model.parameters())
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(1, 11):
        _adam_grads(ref, step)
        ref_opt.step()
        _adam_grads(model, step)
        multi_tensor_applier(amp_C.multi_tensor_adam, flag, [[p.grad for p in params], params, exp_avgs, exp_avg_sqs],
                             hyper["lr"], 0.9, 0.99, hyper["eps"], step, mode, 1, hyper["weight_decay"])
    for p, q, m, v in zip(ref.parameters(), params, exp_avgs, exp_avg_sqs):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, ref_opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v, ref_opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert flag.item() == 0


def test_multi_tensor_adam_without_bias_correction_and_fp16():
    """bias_correction=0 and float16 tensors against the formula in float64, rounded once."""
    g = torch.Generator().manual_seed(4)
    grad, param = torch.randn(7, generator=g), torch.randn(7, generator=g)
    m, v = torch.randn(7, generator=g) * 0.1, torch.rand(7, generator=g) * 0.1
    lists = [[t.clone().half()] for t in (grad, param, m, v)]
    amp_C.multi_tensor_adam(65536, torch.zeros(1, dtype=torch.int32), lists, 0.1, 0.8, 0.9, 1e-3, 3, 1, 0, 0.01)
    g64, p64, m64, v64 = (t.half().double() for t in (grad, param, m, v))
    m_new = 0.8 * m64 + 0.2 * g64
    v_new = 0.9 * v64 + 0.1 * g64 * g64
    p_new = p64 - 0.1 * (m_new / (v_new.sqrt() + 1e-3) + 0.01 * p64)
    for out, expected in zip((lists[1][0], lists[2][0], lists[3][0]), (p_new, m_new, v_new)):
        torch.testing.assert_close(out.double(), expected.half().double(), rtol=2e-3, atol=1e-4)
    assert torch.equal(lists[0][0], grad.half())  # the gradients are not modified


class _FairseqStyleFusedAdam(ampinit.optim.FusedAdam):
    """fairseq's FusedAdamV2, condensed: it requires ``multi_tensor_adam`` on apex's FusedAdam and
    overrides step() with apex's own loop (group step count, FP32 copies of fp16 params)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version of apex.")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            lists, originals = [[], [], [], []], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float)
                for target, value in zip(lists, (p.grad.float(), p.float(), state["exp_avg"], state["exp_avg_sq"])):
                    target.append(value)
                originals.append(p)
            if originals:
                multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, lists, group["lr"],
                                     group["betas"][0], group["betas"][1], group["eps"], group["step"],
                                     self.adam_w_mode, 1 if group["bias_correction"] else 0, group["weight_decay"])
                for original, updated in zip(originals, lists[1]):
                    original.copy_(updated)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_fairseq_fused_adam_v2_pattern(adam_w_mode):
    """The subclass constructs (it probes multi_tensor_adam), steps like torch.optim.AdamW/Adam,
    and its checkpoint (apex's layout: the step count in the group) continues in ampinit's
    FusedAdam like the uninterrupted torch run."""
    hyper = dict(lr=1e-2, eps=1e-8, weight_decay=0.05)
    ref = _adam_model()
    ref_opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(ref.parameters(), **hyper)
    model = _adam_model()
    opt = _FairseqStyleFusedAdam(model.parameters(), adam_w_mode=adam_w_mode, **hyper)
    assert opt._dummy_overflow_buf.dtype == torch.int32 and opt._dummy_overflow_buf.item() == 0
    for step in range(1, 9):
        _adam_grads(ref, step)
        ref_opt.step()
        _adam_grads(model, step)
        opt.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    saved = copy.deepcopy(opt.state_dict())
    own_model = copy.deepcopy(model)  # fairseq resumes into its own class, which counts in the group (E11)
    own = _FairseqStyleFusedAdam(own_model.parameters(), adam_w_mode=adam_w_mode, **hyper)
    own.load_state_dict(copy.deepcopy(saved))
    resumed = ampinit.optim.FusedAdam(model.parameters(), adam_w_mode=adam_w_mode, **hyper)
    resumed.load_state_dict(saved)
    for step in range(9, 14):
        _adam_grads(ref, step)
        ref_opt.step()
        _adam_grads(model, step)
        resumed.step()
        _adam_grads(own_model, step)
        own.step()
    for p, q, r in zip(ref.parameters(), model.parameters(), own_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r, p, rtol=1e-5, atol=1e-6)
    assert own.param_groups[0]["step"] == 13


class _ThinFusedAdam(ampinit.optim.FusedAdam):
    """A subclass whose step() only wraps FusedAdam's (logging, timing)."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("resume", ["state_dict", "deepcopy"])
def test_a_thin_subclass_saves_the_step_count_it_reached_not_the_one_it_loaded(resume):
    """A subclass that overrides step() keeps an apex checkpoint's group step (fairseq's reads
    it); one that steps through FusedAdam's update counts per param, and its next checkpoint
    must carry that count: a resume into a class that counts in the group (fairseq's) went
    on from the loaded count, restarting part of Adam's bias correction without a word."""
    hyper = dict(lr=1e-2, eps=1e-8, weight_decay=0.05)
    ref = _adam_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    for step in range(1, 6):
        _adam_grads(ref, step)
        ref_opt.step()
    model = copy.deepcopy(ref)
    thin = _ThinFusedAdam(model.parameters(), **hyper)
    saved = copy.deepcopy(ref_opt.state_dict())
    for entry in saved["state"].values():  # apex's layout: the count in the group
        entry.pop("step")
    saved["param_groups"][0]["step"] = 5
    thin.load_state_dict(saved)
    for step in range(6, 10):
        _adam_grads(ref, step)
        ref_opt.step()
        _adam_grads(model, step)
        thin.step()
    # a deepcopy (or pickle) saves the groups as they are: it must carry the count too
    checkpoint = thin.state_dict() if resume == "state_dict" else copy.deepcopy(thin).state_dict()
    assert checkpoint["param_groups"][0]["step"] == 9
    own_model = copy.deepcopy(model)
    own = _FairseqStyleFusedAdam(own_model.parameters(), **hyper)
    own.load_state_dict(checkpoint)
    for step in range(10, 14):
        _adam_grads(ref, step)
        ref_opt.step()
        _adam_grads(own_model, step)
        own.step()
    for p, q in zip(ref.parameters(), own_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_rows_of_one_numel_and_different_shapes_are_read_as_flat_memory():
    """apex's kernels read every tensor as flat memory, so apex-era code pairs a (4, 4)
    gradient with a (16,) slice of a flat master buffer; ampinit's kernels take one shape per
    row, and the apex ops pass such rows as flat views.  Against the same ops on tensors of one
    shape; a non-contiguous tensor in such a row is refused (apex read it in the wrong order)."""
    flag = _flag("cpu")
    grads = [torch.randn(4, 4).half(), torch.randn(3, 2).half()]
    flat = torch.zeros(22)
    views = [flat[:16], flat[16:]]
    amp_C.multi_tensor_scale(CHUNK, flag, [grads, views], 0.5)
    assert torch.equal(flat, torch.cat([(g.float() * 0.5).reshape(-1) for g in grads]))
    out = torch.zeros(22)
    amp_C.multi_tensor_axpby(CHUNK, flag, [grads, views, [out[:16], out[16:]]], 2.0, 1.0, -1)
    assert torch.equal(out, torch.cat([g.float().reshape(-1) * 2 for g in grads]) + flat)
    assert flag.item() == 0
    with pytest.raises(ValueError, match="not contiguous"):
        amp_C.multi_tensor_scale(CHUNK, flag, [[torch.randn(4, 4).t()], [torch.zeros(16)]], 0.5)
