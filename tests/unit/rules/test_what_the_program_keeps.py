"""What the program keeps is not the model's computation (docs/never-changes.md):
weights are built at the precision plain torch gives, code that averages,
merges or samples with them runs uncast (a list of entry points, data, that
a user can extend and that resolves libraries imported after convert()),
precision-critical modules run in float32 by default, and training without
float32 master weights is said once."""

import math
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tiny_llama_config, write
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp

FP32, BF16 = torch.float32, torch.bfloat16


# -- weights are built at the precision plain torch gives -----------------------------------------


class PositionalEncoding(nn.Module):  # the PyTorch tutorial's, a table registered as a buffer
    def __init__(self, d_model=16, max_len=64):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)


def _built(scale, init_values):
    class Block(nn.Module):  # defined here: also while converted, through the subclass hook
        def __init__(self):
            super().__init__()
            self.pos_embed = nn.Parameter(torch.randn(1, 8, 16) * scale)
            self.gamma = nn.Parameter(init_values * torch.ones(16))
            self.proj = nn.Linear(16, 16)
            self.pe = PositionalEncoding()
            self.lora_a = nn.Parameter(torch.randn(16, 4) / math.sqrt(4))

    torch.manual_seed(0)
    return Block()


@settings(max_examples=15, deadline=None)
@given(scale=st.sampled_from([0.02, 1e-3, 0.1234567]), init_values=st.sampled_from([1e-5, 0.1234567, 1.0]))
def test_a_model_built_after_convert_holds_what_plain_torch_builds(scale, init_values):
    plain = _built(scale, init_values).state_dict()
    with hmp.converted():
        mixed = _built(scale, init_values).state_dict()
    assert plain.keys() == mixed.keys()
    for key in plain:
        assert mixed[key].dtype == plain[key].dtype and torch.equal(mixed[key], plain[key]), key


def test_from_pretrained_after_convert_loads_the_checkpoints_values(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(
        num_channels=3,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        num_labels=2,
        layer_scale_init_value=0.1234567,
    )
    torch.manual_seed(0)
    transformers.ConvNextForImageClassification(config).save_pretrained(tmp_path)
    plain = transformers.ConvNextForImageClassification.from_pretrained(tmp_path).state_dict()
    with hmp.converted():
        mixed = transformers.ConvNextForImageClassification.from_pretrained(tmp_path).state_dict()
    for key in plain:
        assert mixed[key].dtype == plain[key].dtype and torch.equal(mixed[key], plain[key]), key


# -- entry points that run uncast: data, extendable, resolved when imported -----------------------


def _package(tmp_path, name):
    """A package the test imports after convert(): an updater and a base class."""
    root = tmp_path / "site"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "updates.py").write_text(
        textwrap.dedent("""
        import torch

        def soft(target, source, tau):
            return target * (1 - tau) * 0.5 + source * tau

        class Updater:
            def update(self, x):
                return x * 0.5, torch.is_grad_enabled()
    """)
    )
    return root


def test_an_entry_of_a_module_imported_after_convert_runs_uncast(tmp_path, monkeypatch):
    name = f"hmp_late_{id(tmp_path) & 0xFFFF:x}"
    monkeypatch.syspath_prepend(str(_package(tmp_path, name)))
    entries = write(tmp_path, "uncast.txt", f"include default\n{name}.updates.soft\n{name}.updates.Updater.update\n")
    x = torch.randn(4)
    with hmp.converted(strict=True, uncast_file_path=entries):  # strict: the pointwise probes cast
        assert name not in sys.modules
        updates = __import__(f"{name}.updates", fromlist=["soft"])
        assert updates.soft(x, x, 0.3).dtype == FP32

        class Mine(updates.Updater):  # a subclass defined while converted, with its own method
            def update(self, x):
                return x * 0.25

        assert updates.Updater().update(x)[0].dtype == FP32 and Mine().update(x).dtype == FP32
        assert (x * 0.5).dtype == BF16  # the same op outside the entries still casts
    assert not hasattr(updates.soft, "__hmp_original__")  # the module's own function again
    assert not hasattr(Mine.update, "__hmp_original__")
    assert not any(type(f).__module__ == "hmp.binding.imports" for f in sys.meta_path)


@pytest.fixture
def construction(tmp_path):
    """An uncast calls file naming construction (``torch.nn.Module.__init__``):
    no shipped entry needs it since pointwise ops are never cast by default,
    so these tests run under strict=True, where a constructor's products are."""
    return write(tmp_path, "construction.txt", "include default\ntorch.nn.Module.__init__\n")


def test_a_user_list_of_entries_is_checked_and_can_take_one_out(tmp_path, construction):
    bad = write(tmp_path, "bad.txt", "include default\nnodots\ninclude bf16\n")
    with pytest.raises(ValueError, match=r"line 2: 'nodots' is no dotted path[\s\S]*line 3"):
        hmp.convert(uncast_file_path=bad)
    assert not hmp.is_converted()
    without = write(tmp_path, "w.txt", "include default\n-peft.tuners.tuners_utils.BaseTunerLayer.unmerge\n")
    with hmp.converted(strict=True, uncast_file_path=construction):
        assert nn.Parameter(torch.ones(3) * 0.1).dtype == BF16  # outside a construction: cast

        class Kept(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3) * 0.1)

        assert Kept().w.dtype == FP32  # the constructor runs uncast: an entry of the user's list
    with hmp.converted(strict=True, uncast_file_path=without):  # strict: the pointwise probes cast
        built = nn.Linear(2, 2)  # nn.Linear initialises in place: still float32

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3) * 0.1)

        assert Scaled().w.dtype == BF16  # the constructor casts under strict=True: no entry names it
    assert built.weight.dtype == FP32


def test_the_shipped_entries_are_shown_and_every_line_is_a_dotted_path():
    path = hmp.list_path("uncast_calls")
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    entries = [line for line in lines if line]
    assert entries and all("." in e for e in entries)
    assert "peft.tuners.tuners_utils.BaseTunerLayer.merge" in entries  # a matrix product: the only kind left


def test_peft_merge_while_converted_is_a_plain_merge():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = tiny_llama_config(layers=1)

    def merged(convert):
        torch.manual_seed(0)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(config),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        for n, p in model.named_parameters():
            if "lora_B" in n:
                nn.init.normal_(p, std=0.05)
        if convert:
            with hmp.converted():
                return model.merge_and_unload().state_dict()
        return model.merge_and_unload().state_dict()

    plain, mixed = merged(False), merged(True)
    for key in plain:
        assert torch.equal(plain[key], mixed[key]), key


def test_a_diffusers_scheduler_step_runs_uncast_and_keeps_latents_float32():
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=50)
    scheduler.set_timesteps(10)
    torch.manual_seed(0)
    sample, noise = torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    t = scheduler.timesteps[0]
    torch.manual_seed(1)
    plain = scheduler.step(noise, t, sample).prev_sample
    with hmp.converted():
        torch.manual_seed(1)
        mixed = scheduler.step(noise, t, sample).prev_sample
    assert mixed.dtype == FP32 and torch.equal(mixed, plain)


# -- precision-critical modules run in float32 by default -----------------------------------------


def test_default_module_entries_are_shown_and_resolve_when_imported(tmp_path, monkeypatch):
    name = f"hmp_rope_{id(tmp_path) & 0xFFFF:x}"
    root = tmp_path / "site"
    (root / name / "models" / "tiny").mkdir(parents=True)
    for d in (root / name, root / name / "models", root / name / "models" / "tiny"):
        (d / "__init__.py").write_text("")
    (root / name / "models" / "tiny" / "modeling_tiny.py").write_text(
        textwrap.dedent("""
        import torch

        class TinyRotaryEmbedding(torch.nn.Module):
            def forward(self, position_ids, inv_freq):
                return (position_ids[:, None].float() * inv_freq[None]).cos()
    """)
    )
    monkeypatch.syspath_prepend(str(root))
    fp32 = write(tmp_path, "f.txt", f"include default\n{name}.models.*.modeling_*.*RotaryEmbedding\n")
    positions, inv_freq = torch.arange(4000, 4016), torch.tensor([1.0, 0.5])
    with hmp.converted(strict=True, fp32_file_path=fp32):  # strict: the pointwise probes cast
        assert f"{name}.models.*.modeling_*.*RotaryEmbedding" in hmp.effective_lists()["fp32"]
        assert "transformers.models.*.modeling_*.*RotaryEmbedding" in hmp.effective_lists()["fp32"]
        module = __import__(f"{name}.models.tiny.modeling_tiny", fromlist=["x"])
        out = module.TinyRotaryEmbedding()(positions, inv_freq)
        raw = (positions[:, None].float() * inv_freq[None]).cos()  # the same ops outside the module
    assert out.dtype == FP32 and torch.equal(out, module.TinyRotaryEmbedding()(positions, inv_freq))
    assert raw.dtype == BF16


def test_llama_rotary_angles_at_long_positions_are_float32():
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    config = tiny_llama_config(layers=1, max_position_embeddings=8192)
    rope = modeling_llama.LlamaRotaryEmbedding(config=config)
    x = torch.randn(1, 16, 32)
    positions = torch.arange(4000, 4016)[None]
    plain = rope(x, positions)
    with hmp.converted():
        mixed = rope(x, positions)
    for a, b in zip(plain, mixed):
        assert torch.equal(a, b.to(a.dtype))
    assert len({round(v, 6) for v in mixed[0][0, :2, 0].tolist()}) == 2  # positions 4000 and 4001 differ


# -- no float32 master weights --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_training_lower_precision_parameters_is_said_once(dtype):
    model = nn.Linear(4, 2).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hmp.core.state.warned.discard(("no master weights", torch.optim.SGD))
    with hmp.converted():
        with pytest.warns(UserWarning, match="no float32 master weights") as record:
            for _ in range(3):
                model(torch.randn(3, 4).to(dtype)).float().sum().backward()
                opt.step()
    assert sum("master weights" in str(w.message) for w in record) == 1
    assert record[0].filename == __file__


def test_float32_parameters_train_without_that_warning():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hmp.converted(), warnings.catch_warnings():
        warnings.simplefilter("error")
        F.mse_loss(model(torch.randn(3, 4)).float(), torch.zeros(3, 2)).backward()
        opt.step()


# -- construction runs uncast with no hmp frame between a class's __init__ calls -------------------


class _Levels(nn.Module):
    """Walks its constructors' frames as Lightning's save_hyperparameters does:
    every level's arguments, from the innermost __init__ outwards."""

    def __init__(self, width=3):
        super().__init__()
        frame, self.levels = sys._getframe(), []
        while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is self:
            self.levels.append({k: v for k, v in frame.f_locals.items() if k in ("width", "lr", "depth")})
            frame = frame.f_back
        self.scale = nn.Parameter(torch.ones(4) * 0.1234567)


class _Child(_Levels):
    def __init__(self, lr=0.1, depth=2):
        super().__init__(width=5)
        self.late = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)) * 0.02)


def test_a_construction_keeps_its_frames_and_its_classes_own_init(construction):
    plain = _Child()
    with hmp.converted(strict=True, uncast_file_path=construction):
        assert nn.Linear.__dict__["__init__"] is torch.nn.modules.linear.Linear.__init__  # only Module's is hmp's
        mixed = _Child()
        assert (torch.ones(2) * 3).dtype == BF16  # casts are back once the construction returned
    assert mixed.levels == plain.levels == [{"width": 5}, {"lr": 0.1, "depth": 2}]
    for key, value in plain.state_dict().items():
        assert torch.equal(mixed.state_dict()[key], value) and mixed.state_dict()[key].dtype == FP32, key


def test_a_construction_that_raises_gives_the_casts_back(construction):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            raise RuntimeError("bad config")

    with hmp.converted(strict=True, uncast_file_path=construction):
        with pytest.raises(RuntimeError, match="bad config"):
            Broken()
        assert (torch.ones(2) * 3).dtype == BF16 and sys.getprofile() is None


def test_a_python_profiler_keeps_running_through_a_construction(construction):
    events = []

    def profiler(frame, event, arg):
        events.append(event)

    with hmp.converted(strict=True, uncast_file_path=construction):
        sys.setprofile(profiler)
        try:
            built = _Child()
            still = sys.getprofile()
        finally:
            sys.setprofile(None)
    assert still is profiler and "call" in events and built.late.dtype == FP32


def test_lightning_hyperparameters_of_every_level_are_saved(construction):
    pl = pytest.importorskip("lightning.pytorch")

    class Base(pl.LightningModule):
        def __init__(self, hidden=3, **kwargs):
            super().__init__()
            self.save_hyperparameters()

    class Model(Base):
        def __init__(self, lr=0.1, hidden=5):
            super().__init__(hidden=hidden)
            self.w = nn.Parameter(torch.ones(3) * 0.1234567)

    plain = dict(Model().hparams)
    with hmp.converted(strict=True, uncast_file_path=construction):
        model = Model()
    assert dict(model.hparams) == plain == {"hidden": 5, "lr": 0.1}
    assert model.w.dtype == FP32
