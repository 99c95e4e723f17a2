"""Weight conversion: strict keys and shapes, bit-exact round trips, files and the CLI."""

import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import torch_reference as tr
from parity.commands.convert import main
from train.interop.runs import load_jax_weights, load_torch_weights, save_jax_weights, save_torch_weights
from train.interop.weights import CheckpointMismatchError, expected_jax_params, jax_params, jax_to_torch, torch_to_jax

BASE = dict(src_vocab_size=53, tgt_vocab_size=53, d_model=24, num_heads=3, d_ff=40,
            num_encoder_layers=2, num_decoder_layers=1, max_len=64)
VARIANTS = [
    {},
    {"norm_position": "pre"},
    {"activation": "gelu"},
    {"activation": "swiglu"},
    {"norm": "rmsnorm"},
    {"positions": "learned"},
    {"share_embeddings": False, "tie_output": False, "tgt_vocab_size": 61},
    {"share_embeddings": False, "tgt_vocab_size": 61},
    {"tie_output": False},
    {"attention_bias": False},
    {"activation": "silu", "positions": "sinusoidal_halves", "output_bias": True},
    {"output_bias": True, "tie_output": False},
]


def model(seed=0, **overrides):
    torch.manual_seed(seed)
    return tr.Transformer(tr.TransformerConfig(**{**BASE, **overrides}))


def assert_state_dicts_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "paper")
def test_round_trip_is_bit_exact_for_every_variant(variant):
    torch_model = model(**variant)
    jax_model = torch_to_jax(torch_model)
    # Every parameter arrived, kernels transposed.
    assert set(jax_params(jax_model)) == set(expected_jax_params(torch_model.cfg))
    np.testing.assert_array_equal(
        np.asarray(jax_model.encoder.layers[0].ff.linear1.kernel[...]),
        torch_model.encoder.layers[0].ff.linear1.weight.detach().numpy().T,
    )
    assert_state_dicts_identical(torch_model.state_dict(), jax_to_torch(jax_model).state_dict())


def test_shared_and_tied_parameters_are_one_key():
    keys = set(expected_jax_params(model().cfg))
    assert "src_embed.embedding" in keys
    assert not any(k.startswith(("tgt_embed", "out_proj")) for k in keys)
    untied = set(expected_jax_params(model(share_embeddings=False, tie_output=False, tgt_vocab_size=61).cfg))
    assert {"tgt_embed.embedding", "out_proj.kernel"} <= untied


def test_bf16_weights_survive_both_directions():
    torch_model = model().to(torch.bfloat16)
    jax_model = torch_to_jax(torch_model)
    assert jax_model.src_embed.embedding[...].dtype == jnp.bfloat16
    assert jax_model.encoder.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    back = jax_to_torch(jax_model)
    assert_state_dicts_identical(torch_model.state_dict(), back.state_dict())


def test_mismatch_lists_every_offending_key_with_both_shapes():
    state = model().state_dict()
    cfg = model().cfg
    del state["encoder.layers.0.ff.linear1.bias"]
    state["decoder.layers.0.extra.weight"] = torch.zeros(2, 3)
    state["encoder.layers.1.self_attn.q_proj.weight"] = torch.zeros(24, 25)
    with pytest.raises(CheckpointMismatchError) as err:
        torch_to_jax(state, cfg)
    message = str(err.value)
    assert "missing     encoder.layers.0.ff.linear1.bias  expected (40,)" in message
    assert "unexpected  decoder.layers.0.extra.weight  got (2, 3)" in message
    assert "wrong shape encoder.layers.1.self_attn.q_proj.weight  expected (24, 24), got (24, 25)" in message
    assert len(err.value.missing) == len(err.value.unexpected) == len(err.value.wrong_shape) == 1


def test_wrong_architecture_is_refused_in_both_directions():
    small = model()
    other_cfg = small.cfg.replace(d_ff=48, num_decoder_layers=2)
    with pytest.raises(CheckpointMismatchError) as err:
        torch_to_jax(small.state_dict(), other_cfg)
    assert "decoder.layers.1.self_attn.q_proj.weight" in str(err.value)  # the missing layer is named
    with pytest.raises(CheckpointMismatchError):
        jax_to_torch(torch_to_jax(small), other_cfg)
    with pytest.raises(ValueError, match="needs `cfg`"):
        torch_to_jax(small.state_dict())


def test_files_round_trip_and_carry_the_config(tmp_path):
    torch_model = model(norm_position="pre", activation="swiglu")
    path = save_torch_weights(torch_model, tmp_path / "torch" / "model.safetensors")
    # The config travels in the file's metadata; nothing else is written beside it.
    assert [p.name for p in (tmp_path / "torch").iterdir()] == ["model.safetensors"]
    state, cfg = load_torch_weights(path)
    assert cfg == torch_model.cfg
    save_jax_weights(torch_to_jax(state, cfg), tmp_path / "jax")
    restored = load_jax_weights(tmp_path / "jax")
    assert restored.cfg == torch_model.cfg
    assert_state_dicts_identical(torch_model.state_dict(), jax_to_torch(restored).state_dict())


def test_bf16_survives_the_files(tmp_path):
    jax_model = torch_to_jax(model().to(torch.bfloat16))
    save_jax_weights(jax_model, tmp_path / "jax")
    restored = load_jax_weights(tmp_path / "jax")
    assert np.asarray(restored.src_embed.embedding[...]).dtype == ml_dtypes.bfloat16


def test_cli_round_trip_and_errors(tmp_path, capsys):
    torch_model = model(positions="learned", tie_output=False)
    src = save_torch_weights(torch_model, tmp_path / "a" / "model.safetensors")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "parity.commands.convert", *map(str, args)], capture_output=True,
                              text=True)

    done = cli("--to", "jax", "--src", src, "--dst", tmp_path / "jax")
    assert done.returncode == 0, done.stderr
    done = cli("--to", "torch", "--src", tmp_path / "jax", "--dst", tmp_path / "b" / "model.safetensors")
    assert done.returncode == 0, done.stderr
    state, cfg = load_torch_weights(tmp_path / "b" / "model.safetensors")
    assert cfg == torch_model.cfg
    assert_state_dicts_identical(torch_model.state_dict(), state)

    def refused(*args) -> tuple[int, str]:
        """The exit status and stderr of `main` (in this process: a subprocess costs ~5 s of imports)."""
        capsys.readouterr()
        return main(list(map(str, args))), capsys.readouterr().err

    # An existing destination is never overwritten silently.
    code, err = refused("--to", "jax", "--src", src, "--dst", tmp_path / "jax")
    assert code == 1 and "--overwrite" in err  # a refused destination: exit 1 (2 is for flags)

    # A config that does not fit the weights: one message listing the keys, no traceback.
    (tmp_path / "jax" / "config.json").write_text(torch_model.cfg.replace(d_ff=48).to_json())
    code, err = refused("--to", "torch", "--src", tmp_path / "jax", "--dst", tmp_path / "c.safetensors")
    assert code == 1
    assert "wrong shape encoder.layers.0.ff.linear1.kernel  expected (24, 48), got (24, 40)" in err
    assert "Traceback" not in err

    code, err = refused("--to", "jax", "--src", tmp_path / "missing.safetensors", "--dst", tmp_path / "d")
    assert code == 1 and "no weights file" in err


@pytest.mark.parametrize("flag,value", [("--checkpoint", "5"), ("--proof-sentences", "missing.txt")])
@pytest.mark.parametrize("source", [["--to", "jax", "--src", "model.safetensors"], ["--to", "torch", "--src", "jax/"],
                                    ["--to", "torch", "--from", "marian", "--src", "hf-dir"]])
def test_cli_refuses_run_flags_without_a_run(source, flag, value, tmp_path, capsys):
    """Weights alone and a Marian import have no checkpoint to pick nor proof to run: the flag was ignored."""
    assert main([*source, "--dst", str(tmp_path / "out"), flag, value]) == 1
    assert f"error: {flag} goes with --run-dir, or with --to marian, ctranslate2, onnx or stablehlo" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_writes_into_an_empty_destination_directory(tmp_path):
    """An empty --dst holds nothing to replace: written without --overwrite, as aiayn average writes one."""
    src = save_torch_weights(model(), tmp_path / "model.safetensors")
    (tmp_path / "jax").mkdir()
    assert main(["--to", "jax", "--src", str(src), "--dst", str(tmp_path / "jax")]) == 0
    assert sorted(p.name for p in (tmp_path / "jax").iterdir()) == ["config.json", "params"]


def test_cli_names_proof_sentences_in_its_errors(tmp_path, capsys):
    """A directory given as --proof-sentences: the error names that flag (the reader's default was --input)."""
    assert main(["--to", "jax", "--run-dir", str(tmp_path), "--dst", str(tmp_path / "out"), "--proof-sentences",
                 str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"error: --proof-sentences {tmp_path} is a directory; "
                                       "give a file (one sentence per line)\n")
    assert not (tmp_path / "out").exists()


def test_cli_help_explains_both_directions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--to" in out and "safetensors" in out and "orbax" in out


class Boom:
    """Unpickling this runs code: it writes the file `target`."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (exec, (f"open({self.target!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "model.bin"])
def test_no_pickle_is_executed(tmp_path, name):
    """A pickle that would run code when unpickled is refused without running: as .safetensors it
    is not a safetensors file; as a legacy file torch.load(weights_only=True) refuses `exec`."""
    import pickle

    torch_model = model()
    (tmp_path / "config.json").write_text(torch_model.cfg.to_json())
    path = tmp_path / name
    if name.endswith(".safetensors"):
        path.write_bytes(pickle.dumps(Boom(tmp_path / "pwned")))
    else:  # in torch.save's own zip format, the state dict holding the trap beside real weights
        torch.save({**torch_model.state_dict(), "trap": Boom(tmp_path / "pwned")}, path)
    message = "not a readable safetensors file" if name.endswith(".safetensors") else "refused by torch.load"
    with pytest.raises(ValueError, match=message):
        load_torch_weights(path)
    assert not (tmp_path / "pwned").exists()


def test_legacy_state_dict_files_load(tmp_path):
    torch_model = model()
    (tmp_path / "config.json").write_text(torch_model.cfg.to_json())
    torch.save(torch_model.state_dict(), tmp_path / "model.pt")
    state, cfg = load_torch_weights(tmp_path / "model.pt")
    assert cfg == torch_model.cfg
    assert_state_dicts_identical(torch_model.state_dict(), jax_to_torch(torch_to_jax(state, cfg)).state_dict())
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds no state dict"):
        load_torch_weights(tmp_path / "list.pt")
