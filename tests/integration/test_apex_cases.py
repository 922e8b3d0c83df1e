"""The behaviours NVIDIA apex amp O1's own tests assert (tests/L0/run_amp: basic casts, promotion,
the weight cache, RNNs), restated for hmp in bfloat16 on the CPU and run on both engines
(docs/engines.md). Where hmp's rule differs from apex's, the test asserts hmp's documented answer
and says why; apex's float16-only cases (banned ops, in-place errors) become hmp's answer for them."""

import functools
import itertools
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import skip_without_bf16_lstm

import hmp

ENGINES = ("python", "autocast")
FLOAT, BF16 = torch.float32, torch.bfloat16
DTYPES = (FLOAT, BF16)
ALWAYS_BF16 = {FLOAT: BF16, BF16: BF16}
ALWAYS_FLOAT = {FLOAT: FLOAT, BF16: FLOAT}
MATCH_INPUT = {FLOAT: FLOAT, BF16: BF16}
N, C, H, K, STEPS = 4, 4, 8, 3, 4  # batch, channels, features, kernel, time steps

each_engine = pytest.mark.parametrize("engine", ENGINES, indirect=True)


def dtype_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.fixture
def engine(request):
    """convert() with the engine named, so HMP_ENGINE in the environment decides nothing here."""
    hmp.revert()
    hmp.convert(engine=request.param)
    # an FP32-list loss is left to autocast's dispatcher (it agrees for every dtype mix); linear is not
    mse_loss = hmp.effective_lists(detail=True)["fp32"]["mse_loss"]
    assert ("torch.autocast's dispatcher" in mse_loss) == (request.param == "autocast"), mse_loss
    yield request.param
    hmp.revert()


def check_layer(fn, shape, expected, backward=True):
    """fn on a float32 and on a bfloat16 input: the output's dtype is expected[input's dtype], and
    the input's gradient keeps the input's dtype."""
    for dtype in DTYPES:
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        y = fn(x)
        assert y.dtype == expected[dtype], (dtype, y.dtype)
        if backward:
            y.float().sum().backward()
            assert x.grad.dtype == dtype


# --- basic casts (apex test_basic_casts.py) ---


def _layer(kind, form):
    torch.manual_seed(0)
    if kind == "linear":
        m, shape, f = nn.Linear(H, H), (N, H), F.linear
    else:
        m, shape, f = nn.Conv2d(C, C, K), (N, C, H, H), F.conv2d
    return (m if form == "module" else functools.partial(f, weight=m.weight, bias=m.bias)), shape


@each_engine
@pytest.mark.parametrize("kind", ["linear", "conv2d"])
@pytest.mark.parametrize("form", ["module", "function"])
def test_linear_and_conv_run_in_bf16(engine, kind, form):
    fn, shape = _layer(kind, form)
    check_layer(fn, shape, ALWAYS_BF16)


@each_engine
def test_softmax_and_mse_loss_run_in_fp32_and_group_norm_follows_its_input(engine):
    fp32 = hmp.effective_lists()["fp32"]
    assert {"softmax", "mse_loss"} <= set(fp32)
    for fn in (nn.Softmax(dim=1), functools.partial(F.softmax, dim=1)):
        check_layer(fn, (N, H), ALWAYS_FLOAT)
    target = torch.randn(N, H)
    for fn in (lambda x: nn.MSELoss()(x, target), functools.partial(F.mse_loss, target=target)):
        check_layer(fn, (N, H), ALWAYS_FLOAT)
    # apex lists group_norm as FP32; hmp's FP32 list leaves norms to torch, which accumulates bf16
    # in float32 (docs/never-changes.md#torchautocasts-float32-ops)
    assert "group_norm" not in fp32
    check_layer(nn.GroupNorm(2, C), (N, C, H, H), MATCH_INPUT)


@each_engine
def test_relu_and_batch_norm_follow_their_input(engine):
    for fn in (nn.ReLU(), F.relu):
        check_layer(fn, (N, H), MATCH_INPUT)
    bn = nn.BatchNorm2d(C)
    stats = dict(running_mean=bn.running_mean, running_var=bn.running_var, weight=bn.weight, bias=bn.bias)
    check_layer(bn, (N, C, H, H), MATCH_INPUT)
    check_layer(functools.partial(F.batch_norm, **stats, training=True), (N, C, H, H), MATCH_INPUT)
    bn.eval()
    for fn in (bn, functools.partial(F.batch_norm, **stats, training=False)):
        check_layer(fn, (N, C, H, H), MATCH_INPUT, backward=False)
    assert bn.running_mean.dtype == bn.running_var.dtype == FLOAT  # a written buffer keeps its dtype


@each_engine
def test_matmul_as_method_and_operator_in_both_orders_runs_in_bf16(engine):
    other = torch.randn(H, H)
    fns = (lambda x: x.matmul(other), lambda x: other.matmul(x), lambda x: x @ other, lambda x: other @ x)
    for fn in fns:
        check_layer(fn, (H, H), ALWAYS_BF16)


@each_engine
def test_pow_and_sum_follow_their_input(engine):
    # apex computes pow and sum in float32; in hmp pow is a promote entry and sum in no list, so
    # torch's own dtype stands: the consumer decides (README "Rules";
    # docs/never-changes.md#torchautocasts-float32-ops: torch accumulates bf16 sums in float32)
    lists = hmp.effective_lists()
    assert "pow" in lists["promote"] and not any("sum" in lists[k] for k in lists)
    for fn in (lambda x: x.pow(2.0), lambda x: x**2.0, lambda x: x.sum()):
        check_layer(fn, (N, H), MATCH_INPUT)


@each_engine
def test_cpu_is_no_precision_choice(engine):
    # apex's FP32 list names cpu; in hmp a view or copy is never cast (docs/never-changes.md#views-stay-views)
    for dtype in DTYPES:
        x = torch.randn(N, H, dtype=dtype)
        assert x.cpu() is x


@each_engine
def test_binary_cross_entropy_runs_in_fp32_where_apex_bans_it(engine):
    # apex refuses it in float16; hmp's FP32 list takes bf16 probabilities to float32
    target = torch.rand(N, H)
    for fn in (lambda x: nn.BCELoss()(x, target), functools.partial(F.binary_cross_entropy, target=target)):
        x = torch.rand(N, H, dtype=BF16, requires_grad=True)
        y = fn(x)
        y.backward()
        assert y.dtype == FLOAT and x.grad.dtype == BF16


@each_engine
def test_an_in_place_fp32_op_keeps_the_written_dtype(engine):
    # apex raises on an in-place FP32-list op of a float16 tensor; hmp runs it in the written
    # tensor's dtype, as torch does (README "Rules": in-place forms)
    assert "log" in hmp.effective_lists()["fp32"]
    x = torch.rand(N, H, dtype=BF16) + 0.5
    with hmp.disable_casts():
        want = x.clone().log_()
    x.log_()
    assert x.dtype == BF16 and torch.equal(x, want)


# --- promotion (apex test_promotion.py) ---

BINARY = {
    "torch.mul": torch.mul,
    "Tensor.mul": torch.Tensor.mul,
    "torch.atan2": torch.atan2,
    "Tensor.atan2": torch.Tensor.atan2,
}


@each_engine
@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("xtype,ytype", list(itertools.product(DTYPES, DTYPES)), ids=dtype_id)
def test_out_of_place_binary_ops_give_the_widest_dtype(engine, name, xtype, ytype):
    x = torch.randn(N, dtype=xtype, requires_grad=True)
    y = torch.randn(N, dtype=ytype, requires_grad=True)
    out = BINARY[name](x, y)
    assert out.dtype == (BF16 if xtype == ytype == BF16 else FLOAT)
    with hmp.disable_casts():
        assert torch.equal(out, BINARY[name](x, y))  # torch's own promotion, bit for bit
    out.float().sum().backward()
    assert (x.grad.dtype, y.grad.dtype) == (xtype, ytype)


@each_engine
@pytest.mark.parametrize("op", [torch.Tensor.add_, operator.iadd], ids=["add_", "+="])
@pytest.mark.parametrize("xtype,ytype", list(itertools.product(DTYPES, DTYPES)), ids=dtype_id)
def test_in_place_add_keeps_its_self_dtype(engine, op, xtype, ytype):
    leaf = torch.randn(N, dtype=xtype, requires_grad=True)
    y = torch.randn(N, dtype=ytype, requires_grad=True)
    out = op(leaf.clone(), y)  # a non-leaf to write in place
    assert out.dtype == xtype
    out.float().sum().backward()
    assert (leaf.grad.dtype, y.grad.dtype) == (xtype, ytype)


@each_engine
def test_cat_gives_the_widest_dtype(engine):
    ys = [torch.randn(N, dtype=BF16, requires_grad=True) for _ in range(5)]
    wide = torch.randn(N, requires_grad=True)
    out = torch.cat(ys + [wide])
    assert out.dtype == FLOAT
    out.sum().backward()
    assert wide.grad.dtype == FLOAT and all(y.grad.dtype == BF16 for y in ys)
    assert torch.cat(ys + [torch.randn(N, dtype=BF16)]).dtype == BF16


# --- the weight cache (apex test_cache.py) ---


def mm_twice(x, w):  # BF16 list: the weight is used twice in one forward
    return x.mm(w).mm(w).sum()


def mul_twice(x, w):  # promote list
    return ((x * w) * w).sum()


def mse_twice(x, w):  # FP32 list: a bf16 weight is cast up
    return (x + F.mse_loss(w, x, reduction="none") + F.mse_loss(w, -x, reduction="none")).sum()


CACHE_OPS = {"mm": (mm_twice, (4, 4)), "mul": (mul_twice, (2, 4)), "mse_loss": (mse_twice, (2, 4))}


def reference(ops, x, w):
    """The loss and gradient in float32 on fresh copies: no cache can hold them."""
    w32 = w.detach().clone().float().requires_grad_()
    with hmp.disable_casts():
        loss = ops(x.detach().clone().float(), w32)
        loss.backward()
    return loss.detach(), w32.grad


def train_eval_write_train(ops, shape, wtype, frozen):
    """apex's sequence: a training step, an evaluation under no_grad, a write through .data, a
    training step; each gradient and evaluation checked against the float32 reference. Small
    integers (and a power-of-two step) keep bf16 nearly exact, so a stale copy of the weight (off
    by the update or by 1) is far outside the tolerance. Returns what it computed."""
    w = nn.Parameter((torch.arange(shape[0] * shape[1]).view(shape) % 3 - 1).to(wtype))
    x = (torch.arange(8).view(2, 4) % 2 + 1).float()
    opt = torch.optim.SGD([w], lr=2**-4)
    block = hmp.frozen_weights if frozen else torch.enable_grad  # frozen: promises no alias write inside
    seen = []

    def check(got, want, stale):
        tol = dict(rtol=2**-6, atol=2**-6)
        torch.testing.assert_close(got.float(), want, **tol)
        assert not torch.allclose(stale, want, **tol), "the case cannot tell a stale copy"
        seen.append(got.detach().clone())

    def step():
        w.grad = None
        loss = ops(x, w)
        loss.backward()
        assert w.grad.dtype == wtype
        check(w.grad, reference(ops, x, w)[1], reference(ops, x, w.detach() + 1)[1])
        opt.step()

    def evaluate(before_update):
        want, stale = reference(ops, x, w)[0], reference(ops, x, before_update)[0]
        with torch.no_grad():
            check(ops(x, w), want, stale)

    for _ in range(2):
        with block():
            old = w.detach().clone()
            step()
            evaluate(old)
        w.data -= 1  # a write no version counter shows, outside any block
    with block():
        step()
    return seen


@each_engine
@pytest.mark.parametrize("frozen", [False, True], ids=["plain", "frozen_weights"])
@pytest.mark.parametrize("wtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("ops", sorted(CACHE_OPS))
@pytest.mark.filterwarnings("ignore:hmp. SGD updates bfloat16 parameters")
def test_no_stale_weight_copy_across_train_eval_and_a_data_write(engine, ops, wtype, frozen):
    train_eval_write_train(*CACHE_OPS[ops], wtype, frozen)


# --- RNNs (apex test_rnn.py) ---

CELLS = {"RNNCell": nn.RNNCell, "GRUCell": nn.GRUCell, "LSTMCell": nn.LSTMCell}
RNNS = {"RNN": functools.partial(nn.RNN, nonlinearity="relu"), "GRU": nn.GRU, "LSTM": nn.LSTM}
RNN_CONFIGS = [(1, False), (2, False), (2, True)]


def run_cell(cell, dtype, lstm):
    xs = [torch.randn(N, H, dtype=dtype, requires_grad=True) for _ in range(STEPS)]
    h = torch.zeros(N, H, dtype=dtype)
    hidden = (h, h) if lstm else h
    outputs = []
    for x in xs:
        hidden = cell(x, hidden)
        outputs.append(hidden[0] if lstm else hidden)
    outputs[-1].float().sum().backward()
    return xs, outputs


@each_engine
@pytest.mark.parametrize("name", sorted(CELLS))
def test_rnn_cells_over_several_steps_run_in_bf16(engine, name):
    cell = CELLS[name](H, H)
    for dtype in DTYPES:
        xs, outputs = run_cell(cell, dtype, name == "LSTMCell")
        assert all(y.dtype == BF16 for y in outputs)
        assert all(x.grad.dtype == dtype for x in xs)
    assert all(p.dtype == p.grad.dtype == FLOAT for p in cell.parameters())


def run_rnn(rnn, dtype, layers, bidirectional, lstm):
    x = torch.randn(STEPS, N, H, dtype=dtype, requires_grad=True)
    h = torch.zeros(layers * (1 + bidirectional), N, H, dtype=dtype)
    out, _ = rnn(x, (h, h) if lstm else h)
    out[-1].float().sum().backward()
    return x, out


@each_engine
@pytest.mark.parametrize("name", sorted(RNNS))
@pytest.mark.parametrize("layers,bidirectional", RNN_CONFIGS)
def test_rnns_run_in_bf16(engine, name, layers, bidirectional):
    if name == "LSTM":
        skip_without_bf16_lstm()
    rnn = RNNS[name](H, H, num_layers=layers, bidirectional=bidirectional)
    for dtype in DTYPES:
        x, out = run_rnn(rnn, dtype, layers, bidirectional, name == "LSTM")
        assert out.dtype == BF16 and x.grad.dtype == dtype
    assert all(p.dtype == p.grad.dtype == FLOAT for p in rnn.parameters())


def run_packed(rnn, dtype):
    x = torch.randn(STEPS, N, H, dtype=dtype, requires_grad=True)
    lengths = torch.tensor([STEPS, STEPS - 1, STEPS - 1, 2])  # sorted, unequal
    out, _ = rnn(nn.utils.rnn.pack_padded_sequence(x, lengths), torch.zeros(2, N, H, dtype=dtype))
    out.data.float().sum().backward()
    return x, out.data


@each_engine
def test_a_packed_sequence_runs_in_bf16(engine):
    rnn = nn.RNN(H, H, num_layers=2)
    for dtype in DTYPES:
        x, out = run_packed(rnn, dtype)
        assert out.dtype == BF16 and x.grad.dtype == dtype


# --- the engines agree, bit for bit (docs/engines.md names no difference for these) ---


def on_each_engine(case, *args):
    """case(*args) from the same seed under each engine: {engine: [tensors]}."""
    found = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        with hmp.converted(engine=engine):
            found[engine] = [t.detach() for t in case(*args)]
    return found


def assert_bit_equal(found):
    python, autocast = found["python"], found["autocast"]
    assert len(python) == len(autocast)
    for i, (p, a) in enumerate(zip(python, autocast)):
        assert p.dtype == a.dtype and torch.equal(p, a), f"tensor {i} differs between the engines"


def layer_case(kind, form):
    fn, shape = _layer(kind, form)
    x = torch.randn(shape, requires_grad=True)
    y = fn(x)
    y.float().sum().backward()
    params = fn.parameters() if form == "module" else fn.keywords.values()
    return [y, x.grad] + [p.grad for p in params]


def rnn_case(name, layers, bidirectional):
    if name in CELLS:
        cell = CELLS[name](H, H)
        xs, outputs = run_cell(cell, FLOAT, name == "LSTMCell")
        return outputs + [x.grad for x in xs] + [p.grad for p in cell.parameters()]
    if name == "packed":
        rnn = nn.RNN(H, H, num_layers=2)
        x, out = run_packed(rnn, FLOAT)
    else:
        rnn = RNNS[name](H, H, num_layers=layers, bidirectional=bidirectional)
        x, out = run_rnn(rnn, FLOAT, layers, bidirectional, name == "LSTM")
    return [out, x.grad] + [p.grad for p in rnn.parameters()]


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
@pytest.mark.parametrize("form", ["module", "function"])
def test_linear_and_conv_are_bit_equal_between_engines(kind, form):
    assert_bit_equal(on_each_engine(layer_case, kind, form))


RNN_CASES = [(name, 2, True) for name in sorted(RNNS)] + [(name, 1, False) for name in sorted(CELLS)]


@pytest.mark.parametrize("name,layers,bidirectional", RNN_CASES + [("packed", 2, False)])
def test_rnns_are_bit_equal_between_engines(name, layers, bidirectional):
    if name == "LSTM":
        skip_without_bf16_lstm()
    assert_bit_equal(on_each_engine(rnn_case, name, layers, bidirectional))


# A weight used at several listed calls of one forward shares one cached copy on both engines (hmp's
# cache: no op that casts down is left to autocast): its gradients are summed in the copy's dtype before the
# cast back, where casting per use (cache=False) sums them in the weight's dtype (docs/performance.md,
# docs/engines.md): equal within the rounding of that sum in bfloat16, a few units of its last
# place on the gradient's scale (the terms may cancel, so not of each element).
def assert_within_bf16_sum_rounding(found):
    python, autocast = found["python"], found["autocast"]
    for p, a in zip(python, autocast, strict=True):
        assert p.dtype == a.dtype
        scale = a.float().abs().max().item()
        torch.testing.assert_close(p.float(), a.float(), rtol=0, atol=4 * 2**-8 * scale)


@pytest.mark.parametrize(
    "ops,wtype,compare",
    [
        ("mm", FLOAT, assert_bit_equal),  # the float32 weight feeds two mm calls: one copy on both engines
        ("mm", BF16, assert_bit_equal),
        ("mul", FLOAT, assert_bit_equal),
        ("mul", BF16, assert_bit_equal),
        ("mse_loss", FLOAT, assert_bit_equal),
        ("mse_loss", BF16, assert_bit_equal),
    ],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else getattr(v, "__name__", v),
)
@pytest.mark.filterwarnings("ignore:hmp. SGD updates bfloat16 parameters")
def test_the_cache_sequence_is_equal_between_engines(ops, wtype, compare):
    compare(on_each_engine(train_eval_write_train, *CACHE_OPS[ops], wtype, False))


def used_twice(name):
    """The gradients of a weight used at two calls of one forward, from random values."""
    if name == "RNNCell":
        cell = nn.RNNCell(H, H)
        run_cell(cell, FLOAT, False)
        return [p.grad for p in cell.parameters()]
    ops, wtype = (mm_twice, FLOAT) if name == "mm" else (mse_twice, BF16)
    w = nn.Parameter(torch.randn(H, H, dtype=wtype))
    ops(torch.randn(H, H), w).backward()
    return [w.grad]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["mm", "mse_loss", "RNNCell"])
def test_a_weight_used_twice_gets_its_gradient_within_a_bf16_sum_of_cache_off(engine, name):
    found = {}  # each convert() names its engine; no conversion is active in between
    for cache in (True, False):
        torch.manual_seed(0)
        with hmp.converted(engine=engine, cache=cache):
            found["python" if cache else "autocast"] = used_twice(name)
    assert_within_bf16_sum_rounding(found)


@pytest.mark.parametrize(
    "name,compare",
    [("mm", assert_bit_equal), ("RNNCell", assert_bit_equal), ("mse_loss", assert_within_bf16_sum_rounding)],
    ids=["mm", "RNNCell", "mse_loss"],
)
def test_a_weight_used_twice_gets_the_same_gradient_on_both_engines(name, compare):
    """Both engines keep one copy of a float32 weight cast down for the forward (docs/engines.md): the
    gradient of a weight several calls use is summed in the copy's dtype on each, bit for bit. A
    bfloat16 weight cast up by FP32-list calls (mse_loss) is the named difference: autocast's cache
    keeps casts down from float32 only, so the engine casts it per call and sums in bfloat16."""
    compare(on_each_engine(used_twice, name))
