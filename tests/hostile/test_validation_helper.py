"""The one validation helper every file reader uses: each refusal names file, field, value, fix."""

from __future__ import annotations

import json

import pytest

from lucidlm.errors import ConfigError
from lucidlm.validation import Fields, check_allocation, read_json, read_json_object


def test_fields_check_type_range_and_presence():
    f = Fields({"n": 4, "theta": 1e4, "name": "llama", "flag": True, "half": 2.0}, "cfg.json", ConfigError, fix="edit it")
    assert (f.int("n", low=1), f.float("theta", low=0, low_open=True), f.str("name", choices=["llama"])) == (4, 1e4, "llama")
    assert f.int("half") == 2 and f.int("absent", default=7) == 7 and f.bool("flag") is True
    cases = [(lambda: f.int("n", high=3), r"cfg\.json: field 'n' is 4; expected a value <= 3\. Edit it\."),
             (lambda: f.int("theta", high=10), r"field 'theta' is 10000; expected a value <= 10"),
             (lambda: f.int("flag"), r"field 'flag' is True; expected an integer"),
             (lambda: f.float("name"), r"field 'name' is 'llama'; expected a finite number"),
             (lambda: f.str("name", choices=["gpt2"]), r"expected one of 'gpt2'"),
             (lambda: f.int("missing"), r"required field 'missing' is missing"),
             (lambda: f.object("n"), r"field 'n' is 4; expected an object")]
    for call, message in cases:
        with pytest.raises(ConfigError, match=message):
            call()
    with pytest.raises(ConfigError, match="finite"):
        Fields({"x": float("nan")}, "f", ConfigError).float("x")
    with pytest.raises(ConfigError, match=r"f: expected a JSON object \(\{\.\.\.\}\), found a list"):
        Fields([1], "f", ConfigError)
    with pytest.raises(ConfigError, match=r"field 'lora\.alpha' is 'abc'"):
        Fields({"lora": {"alpha": "abc"}}, "f", ConfigError).object("lora").float("alpha")


@pytest.mark.parametrize("content, message", [
    (b'{"a": 1', r"not valid JSON \(Expecting ',' delimiter at line 1, column 8\)"),
    (b'{"a": "\xff"}', r"not UTF-8 text \(byte 7\)"),
    (b"[" * 100000 + b"]" * 100000, r"nests too deeply|not valid JSON"),
])
def test_read_json_names_the_damage(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_json(path, ConfigError, "model config")
    with pytest.raises(ConfigError, match="not found"):
        read_json(tmp_path / "absent.json", ConfigError)
    with pytest.raises(ConfigError, match="found a directory"):
        read_json(tmp_path, ConfigError)


def test_read_json_object_and_allocation_bound(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(["not", "an", "object"]))
    with pytest.raises(ConfigError, match="found a list"):
        read_json_object(path, ConfigError)
    check_allocation(1 << 20, "a KV cache", ConfigError, "use a shorter context")
    with pytest.raises(ConfigError, match=r"a KV cache would need 4\.0 PB, more than .* Use a shorter context\."):
        check_allocation(4 << 50, "a KV cache", ConfigError, "use a shorter context")
