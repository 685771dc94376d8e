"""Tiny random models with a character tokenizer, one per family, for the inspection tests."""

import pytest
import torch

from lucidlm import LanguageModel, preset
from lucidlm.tokenizers import CharTokenizer

ALPHABET = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.!?'\n<>/"))

# Two layers each, small but with d != nh * hd where the family allows it.
TINY = {
    "gpt2": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
    "llama": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_mlp=48, max_seq_len=64),
    "seed000": dict(d_model=32, n_layers=2, n_heads=4, head_dim=8, d_mlp=64, max_seq_len=64),
    "seed004-words": dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, max_seq_len=64),
}
FAMILIES = sorted(TINY)


def make_tiny(family: str = "llama", seed: int = 0, **overrides) -> LanguageModel:
    tokenizer = CharTokenizer(ALPHABET)
    torch.manual_seed(seed)
    cfg = preset(family, vocab_size=tokenizer.vocab_size, **{**TINY[family], **overrides})
    model = LanguageModel(cfg, tokenizer).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so attention is not uniform
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(params=FAMILIES)
def family_model(request) -> LanguageModel:
    return make_tiny(request.param)


@pytest.fixture
def tiny_model() -> LanguageModel:
    return make_tiny("llama")


@pytest.fixture(scope="session")
def make_model():
    """The factory itself: make_model(family, seed=0, **config_overrides)."""
    return make_tiny


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class HeadlessChromium:
    """Screenshots and DOM dumps of local pages, through Chromium's command line."""

    def __init__(self, binary: str, profile_dir) -> None:
        self.binary, self.profile_dir = binary, profile_dir

    def _run(self, url: str, *extra: str) -> "subprocess.CompletedProcess":
        import subprocess
        command = [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile_dir}", *extra, url]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)

    def screenshot(self, url: str, path, size: str = "1200,900"):
        result = self._run(url, f"--screenshot={path}", f"--window-size={size}")
        assert result.returncode == 0 and path.is_file(), result.stderr[-2000:]
        return path

    def dump_dom(self, url: str) -> str:
        result = self._run(url, "--virtual-time-budget=2000", "--dump-dom")
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout


@pytest.fixture(scope="session")
def chromium(tmp_path_factory) -> HeadlessChromium:
    import shutil
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium); the HTML report's browser "
                    "checks need it")
    return HeadlessChromium(binary, tmp_path_factory.mktemp("chromium-profile"))
