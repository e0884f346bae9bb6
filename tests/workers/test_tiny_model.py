"""The tiny model's files: its depth and dtype are what the vLLM tests rely on (no engine here)."""

import json

import pytest

from natsched.workers.tiny_model import CONFIG, DTYPE, write_tiny_lora, write_tiny_model


def test_the_depth_asked_for_is_the_depth_written(tmp_path):
    shallow = json.loads((write_tiny_model(tmp_path / "a") / "config.json").read_text())
    deep = json.loads((write_tiny_model(tmp_path / "b", layers=16) / "config.json").read_text())
    assert shallow["num_hidden_layers"] == CONFIG["num_hidden_layers"] == 2
    assert deep["num_hidden_layers"] == 16
    assert {k: v for k, v in deep.items() if k != "num_hidden_layers"} == {
        k: v for k, v in shallow.items() if k != "num_hidden_layers"}
    assert CONFIG["num_hidden_layers"] == 2  # the shared dict is not changed by a deeper copy


@pytest.mark.parametrize("layers", [0, -3])
def test_a_model_without_layers_is_refused(tmp_path, layers):
    with pytest.raises(ValueError, match="layers must be >= 1"):
        write_tiny_model(tmp_path / "m", layers=layers)
    assert not (tmp_path / "m").exists()


def test_an_adapter_has_weights_for_every_layer_of_its_base(tmp_path):
    from safetensors import safe_open

    path = write_tiny_lora(tmp_path / "lora", layers=5)
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        layers = {int(k.split(".layers.")[1].split(".")[0]) for k in f.keys()}
    assert layers == set(range(5))


def test_the_served_dtype_is_one_vllm_does_not_turn_into_bfloat16():
    # "auto" would pick bfloat16 on CPU, whose AMX attention kernel dies with SIGILL on this model
    assert DTYPE == "float32" == CONFIG["torch_dtype"]
