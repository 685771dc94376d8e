"""The loading line: printed at once; on a terminal a spinner turns once a wait passes its delay."""

from __future__ import annotations

import io
import time

from lucidlm.commands.loading_status import LoadingStatus


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_at_once_and_no_spinner_when_not_a_terminal():
    out = io.StringIO()
    with LoadingStatus("loading toy", stream=out, delay=0.01):
        assert out.getvalue() == "loading toy ...\n"  # before any work is done
        time.sleep(0.1)
    assert out.getvalue() == "loading toy ...\n"


def test_spinner_after_the_delay_on_a_terminal():
    out = FakeTerminal()
    with LoadingStatus("loading toy", stream=out, delay=0.05) as status:
        assert out.getvalue() == "loading toy ..."
        time.sleep(0.5)
    text = out.getvalue()
    frames = [f for f in LoadingStatus.FRAMES if f"... {f} " in text]
    assert len(frames) >= 2  # it turned
    assert text.endswith(f"\rloading toy ... done in {status.seconds:.1f} s\n")


def test_no_spinner_for_a_quick_load():
    out = FakeTerminal()
    with LoadingStatus("loading toy", stream=out, delay=1.0):
        pass
    assert out.getvalue().startswith("loading toy ...\rloading toy ... done in 0.0 s")


def test_a_compiled_answer_is_announced_until_its_second_piece():
    """The prompt pass compiles before the first piece and the decode step before the second:
    the line stays up (and nothing is streamed) until both are in, then every piece follows."""
    from lucidlm.commands.loading_status import first_piece_announced

    out, seen_while_waiting = FakeTerminal(), []

    def pieces():
        for piece in ["The", " capital", " is", " Paris", "."]:
            seen_while_waiting.append(out.getvalue().endswith("\n"))  # has the status line closed yet?
            yield piece

    shown = first_piece_announced(pieces(), "compiling toy", stream=out)
    assert out.getvalue() == ""  # nothing happens before the caller starts reading
    assert list(shown) == ["The", " capital", " is", " Paris", "."]  # nothing held back or lost
    assert seen_while_waiting == [False, False, True, True, True]
    assert out.getvalue().startswith("compiling toy ...") and " done in " in out.getvalue()


def test_an_empty_or_one_piece_answer_still_closes_the_line():
    from lucidlm.commands.loading_status import first_piece_announced

    for given in ([], ["Paris"]):
        out = io.StringIO()
        assert list(first_piece_announced(iter(given), "compiling toy", stream=out)) == given
        assert out.getvalue() == "compiling toy ...\n"


def test_generate_compile_says_it_is_compiling(tmp_path, monkeypatch, capsys):
    """``lucidlm generate --compile``: after the loading line, a line says the compiler is at
    work until the answer flows (aot_eager stands in for inductor here: same path, no C++
    build), and the answer is the one eager generation gives."""
    import torch

    from lucidlm import LanguageModel, preset
    from lucidlm.cli import build_parser
    from lucidlm.tokenizers import BPETokenizer
    from lucidlm.weights.checkpoint import save_model

    torch.manual_seed(0)
    model = LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=257,
                                 max_seq_len=128, multiple_of=32), BPETokenizer([], {"<eot>": 256}))
    save_model(model, tmp_path)
    eager = model.generate("Hello", max_new_tokens=6, temperature=0, stop_on_eos=False).text
    compile_as_tested = LanguageModel.compile
    monkeypatch.setattr(LanguageModel, "compile", lambda self, **kw: compile_as_tested(self, backend="aot_eager"))
    args = build_parser().parse_args(["generate", "Hello", "--model", str(tmp_path), "--compile", "--stream",
                                      "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"])
    assert args.handler(args) == 0
    captured = capsys.readouterr()
    assert "compiling the generation steps (torch.compile" in captured.err
    assert captured.out == eager + "\n"
