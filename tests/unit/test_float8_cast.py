"""torchao's float8 weight cast in one compiled kernel (extensions/float8_cast.py).

On CUDA the fused cast replaces torchao's three eager kernels at every gather. It must give the
same bytes and the same scale, so it is checked bit for bit against torchao's
``fsdp_pre_all_gather``. Here that runs on CPU, with ``DEVICE_TYPES`` widened to ``"cpu"``, which
compiles the same function with inductor's CPU backend. Training with the fused cast must give
exactly the losses of training without it.
"""

import pytest
import torch

from megatron_fsdp_v2.extensions import float8_cast
from tests.unit.dist_utils import run_distributed

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install '.[float8]')")
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from tests.unit.test_float8 import train_worker  # noqa: E402


def _weight(hp: torch.Tensor, scale) -> WeightWithDynamicFloat8CastTensor:
    config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    from torchao.float8.float8_linear import Float8Linear
    linear = Float8Linear.from_float(torch.nn.Linear(hp.shape[1], hp.shape[0], bias=False), config=config)
    mm_config = linear.linear_mm_config
    return WeightWithDynamicFloat8CastTensor(hp, mm_config, torch.float8_e4m3fn, precomputed_scale=scale)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(float8_cast, "DEVICE_TYPES", ("cuda", "cpu"))


def _values(rows: int, cols: int) -> torch.Tensor:
    """Normal values, values past float8's range on both sides, infinities, a NaN, tiny ones."""
    torch.manual_seed(rows)
    hp = torch.randn(rows, cols) * 3
    flat = hp.view(-1)
    flat[:4] = torch.tensor([1e6, -1e6, float("inf"), float("-inf")])
    flat[4] = float("nan")
    flat[5:9] = torch.tensor([1e-9, -1e-9, 0.0, -0.0])
    return hp


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every byte equal, but a NaN's: both must be NaN, while the sign bit of a NaN made by the
    multiply may differ between backends (inductor on x86 sets it where eager does not)."""
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
    assert int(nan.sum()) == 1                 # the input's one NaN, not a value turned into one


@pytest.mark.parametrize("shape", [(64, 32), (48, 80)])   # two lengths: one compiled graph for both
def test_fused_cast_gives_torchao_bytes_and_scale(on_cpu, shape):
    hp = _values(*shape)
    scale = torch.tensor(448.0 / 6.0)
    local = _weight(hp, scale)
    want, want_meta = local.fsdp_pre_all_gather(None)
    got, got_meta = float8_cast.fused_float8_pre_all_gather(local)
    assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == shape
    assert_same_bytes(got[0], want[0])
    assert got_meta[0] is scale and torch.equal(want_meta[0], scale)


def test_fused_cast_writes_into_a_given_tensor(on_cpu):
    hp = _values(32, 16)  # (its NaN included)
    local = _weight(hp, torch.tensor(12.5))
    into = torch.empty(32, 16, dtype=torch.float8_e4m3fn)
    got, _ = float8_cast.fused_float8_pre_all_gather(local, into)
    assert got[0] is into
    assert_same_bytes(into, local.fsdp_pre_all_gather(None)[0][0])


def test_fused_cast_declines_what_it_does_not_cover(on_cpu, monkeypatch):
    hp = torch.randn(8, 4)
    assert float8_cast.fused_float8_pre_all_gather(_weight(hp, None)) is None        # dynamic amax: torchao's
    assert float8_cast.fused_float8_pre_all_gather(hp) is None                        # not torchao's class
    wrong = torch.empty(4, 8, dtype=torch.float8_e4m3fn)
    assert float8_cast.fused_float8_pre_all_gather(_weight(hp, torch.tensor(2.0)), wrong) is None
    monkeypatch.setattr(float8_cast, "DEVICE_TYPES", ("cuda",))
    assert float8_cast.fused_float8_pre_all_gather(_weight(hp, torch.tensor(2.0))) is None   # CPU: torchao's


def fused_train_worker(rank, world_size, system, steps, fused):
    float8_cast.DEVICE_TYPES = ("cuda", "cpu") if fused else ("cuda",)   # (the pool's workers are reused)
    float8_cast._compiled.clear()
    losses, _ = train_worker(rank, world_size, system, steps, bf16=True)
    return losses, "cast" in float8_cast._compiled      # whether the compiled cast ran


@pytest.mark.parametrize("strategy,world_size", [("optim_grads_params", 1), ("optim_grads_params", 2),
                                                 ("optim", 2)])
def test_training_with_the_fused_cast_equals_torchao_cast(strategy, world_size):
    """One rank: the cast lands in the compute weight's storage; two: in the all-gather's input."""
    plain, plain_compiled = run_distributed(fused_train_worker, world_size, strategy, 4, False)[0]
    fused, fused_compiled = run_distributed(fused_train_worker, world_size, strategy, 4, True)[0]
    assert not plain_compiled and fused_compiled
    assert fused == plain, (fused, plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the fused cast's own target")
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (1000, 24)])
def test_fused_cast_on_cuda_gives_torchao_bytes(shape):
    hp = _values(*shape).cuda()
    local = _weight(hp, torch.tensor(448.0 / 6.0, device="cuda"))
    got, _ = float8_cast.fused_float8_pre_all_gather(local)
    assert_same_bytes(got[0], local.fsdp_pre_all_gather(None)[0][0])


def test_a_cast_that_can_not_compile_falls_back_to_torchao_with_a_warning(on_cpu, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no backend here")
    monkeypatch.setattr(float8_cast, "_compiled", {"cast": broken})
    local = _weight(torch.randn(8, 4), torch.tensor(2.0))
    with pytest.warns(RuntimeWarning, match="RuntimeError: no backend here.*torchao's own cast"):
        assert float8_cast.fused_float8_pre_all_gather(local) is None
    assert float8_cast._compiled["cast"] is None
    assert float8_cast.fused_float8_pre_all_gather(local) is None       # no second try, no second warning


def fused_compile_worker(rank, world_size, strategy, where):
    """The fused cast called from our eager unit hooks while dynamo runs the compiled blocks or model."""
    from tests.unit.test_float8 import compile_worker
    float8_cast.DEVICE_TYPES = ("cuda", "cpu")
    float8_cast._compiled.clear()
    try:
        losses, _ = compile_worker(rank, world_size, strategy, True, where, 4)
    finally:
        float8_cast.DEVICE_TYPES = ("cuda",)
    return losses, "cast" in float8_cast._compiled and float8_cast._compiled["cast"] is not None


@pytest.mark.parametrize("strategy,where", [("optim_grads_params", "model"), ("optim_grads", "block")])
def test_fused_cast_under_a_compiled_model_trains_as_eager(strategy, where):
    from tests.unit.test_float8 import train_worker
    eager = run_distributed(train_worker, 2, strategy, 4, False, True)[0][0]
    losses, compiled_cast = run_distributed(fused_compile_worker, 2, strategy, where)[0]
    assert compiled_cast
    assert losses == pytest.approx(eager, abs=1e-5), (losses, eager)
