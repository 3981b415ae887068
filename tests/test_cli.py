"""`dflash-trt generate` end to end, and every validation error as one line with exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.cli import main


def _run(capsys, *args):
    rc = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_streams_text_and_reports_tau_and_matches_plain_decoding(tiny_dirs, capsys):
    target, drafter = tiny_dirs
    common = ["--target", target, "--prompt", "def add(a, b):", "--max-new-tokens", 20, "--ignore-eos"]
    rc, spec_out, spec_err = _run(capsys, *common, "--drafter", drafter, "--block-size", 4)
    assert rc == 0, spec_err
    rc, ar_out, ar_err = _run(capsys, *common, "--no-drafter")
    assert rc == 0, ar_err
    assert spec_out == ar_out and spec_out.strip()  # greedy speculative text == plain greedy text
    assert "tau=" in spec_err and "tokens/s" in spec_err and "dflash block=4" in spec_err
    assert "tau=1.00" in ar_err and "autoregressive" in ar_err


def test_generate_with_a_tree_matches_plain_decoding_and_bad_trees_are_refused(tiny_dirs, capsys):
    target, drafter = tiny_dirs
    common = ["--target", target, "--prompt", "def add(a, b):", "--max-new-tokens", 20, "--ignore-eos"]
    rc, tree_out, tree_err = _run(capsys, *common, "--drafter", drafter, "--tree", 3, "--tree-top-k", 3)
    assert rc == 0, tree_err
    rc, ar_out, _ = _run(capsys, *common, "--no-drafter")
    assert tree_out == ar_out and tree_out.strip() and "tree 3 nodes top-3" in tree_err
    rc, _, err = _run(capsys, *common, "--drafter", drafter, "--block-size", 4, "--tree", 4)
    assert rc == 2 and "--tree" in err and "at most 3" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, *common, "--drafter", drafter, "--tree", 3, "--tree-top-k", 0)
    assert rc == 2 and "--tree-top-k" in err


def test_prompts_file_batches_requests(tiny_dirs, capsys, tmp_path):
    target, drafter = tiny_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"hello {i}"}) for i in range(3)))
    rc, out, err = _run(capsys, "--target", target, "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", 6, "--max-batch", 2)
    assert rc == 0, err
    assert out.count("--- [") == 3 and "3 request(s)" in err


def test_console_script_runs(tiny_dirs):
    target, drafter = tiny_dirs
    exe = shutil.which("dflash-trt") or pytest.skip("package not installed (pip install -e .)")
    res = subprocess.run([exe, "generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "hi", "--max-new-tokens", "4", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "tau=" in res.stderr


def _edit_config(d, **changes):
    raw = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (d / "config.json").write_text(json.dumps(raw))


def _edit_weights(d, fn):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def _drop_layer_ids_keep_weights(d):
    raw = json.loads((d / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 2]  # fc was built for 2 ids (the default for 2 layers)
    (d / "config.json").write_text(json.dumps(raw))


def _dflash(**kw):
    return lambda d: _edit_config(d, dflash_config={**json.loads((d / "config.json").read_text())["dflash_config"], **kw})


def _pickle_only(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


# (which dir to break, how, the key the error must name, the file it must name)
CASES = {
    "hidden-size": ("drafter", lambda d: _edit_config(d, hidden_size=32), "hidden_size", "config.json"),
    "vocab": ("drafter", lambda d: _edit_config(d, vocab_size=97), "vocab_size", "config.json"),
    "layer-id-out-of-range": ("drafter", _dflash(target_layer_ids=[0, 4]), "dflash_config.target_layer_ids", "config.json"),
    "fc-width": ("drafter", _drop_layer_ids_keep_weights, "fc.weight", "model.safetensors"),
    "mask-id-out-of-vocab": ("drafter", _dflash(mask_token_id=96), "dflash_config.mask_token_id", "config.json"),
    "mask-id-missing": ("drafter", lambda d: _edit_config(d, dflash_config={}), "dflash_config.mask_token_id", "config.json"),
    "num-target-layers": ("drafter", lambda d: _edit_config(d, num_target_layers=5), "num_target_layers", "config.json"),
    "missing-weight": ("drafter", lambda d: _edit_weights(d, lambda t: t.pop("layers.1.mlp.up_proj.weight")), "layers.1.mlp.up_proj.weight", "drafter"),
    "extra-weight": ("drafter", lambda d: _edit_weights(d, lambda t: t.update({"embed_tokens.weight": torch.zeros(96, 64)})), "embed_tokens.weight", "model.safetensors"),
    "wrong-shape": ("drafter", lambda d: _edit_weights(d, lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)})), "layers.0.self_attn.q_proj.weight", "model.safetensors"),
    "drafter-architecture": ("drafter", lambda d: _edit_config(d, architectures=["EagleModel"]), "architectures", "config.json"),
    "target-architecture": ("target", lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "architectures", "config.json"),
    "target-missing-key": ("target", lambda d: _edit_config(d, num_hidden_layers=None), "num_hidden_layers", "config.json"),
    "target-rope-type": ("target", lambda d: _edit_config(d, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_parameters=None), "rope_scaling.rope_type", "config.json"),
    "target-pickle-only": ("target", _pickle_only, "pickle", "target"),
    "target-bad-json": ("target", lambda d: (d / "config.json").write_text("{not json"), "not valid JSON", "config.json"),
    "target-missing-weight": ("target", lambda d: _edit_weights(d, lambda t: t.pop("model.norm.weight")), "model.norm.weight", "target"),
    "block-size-too-big": ("drafter", None, "block_size", "config.json"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_error_is_one_line_naming_file_and_key_with_exit_code_2(tiny_dirs, tmp_path, capsys, case):
    which, breaker, key, file_hint = CASES[case]
    target, drafter = (shutil.copytree(d, tmp_path / d.name) for d in tiny_dirs)
    if breaker is not None:
        breaker(target if which == "target" else drafter)
    extra = ["--block-size", 99] if case == "block-size-too-big" else []
    rc, out, err = _run(capsys, "--target", target, "--drafter", drafter, "--prompt", "x", "--max-new-tokens", 2, *extra)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0] and file_hint in lines[0], lines[0]
    print(lines[0])


def test_module_entry_point_reports_errors_with_exit_code_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--target", str(tmp_path), "--no-drafter", "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: {tmp_path}: no config.json in this directory"]


# --------------------------------------------------------------------------------------------------
# What a first run shows: errors name the flag, numbers are checked, help says every default


def test_a_missing_or_file_model_path_names_the_flag_and_says_why(tiny_dirs, tmp_path, capsys):
    target, drafter = tiny_dirs
    (tmp_path / "file.txt").write_text("x")
    cases = [
        (["generate", "--target", str(tmp_path / "nope"), "--prompt", "x"], "--target: does not exist"),
        (["generate", "--target", str(target), "--drafter", str(tmp_path / "file.txt"), "--prompt", "x"], "--drafter: is not a directory"),
        (["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"], "--checkpoint: does not exist"),
        (["generate", "--target", str(target), "--tokenizer", str(tmp_path / "nope"), "--no-drafter", "--prompt", "x"], "--tokenizer: does not exist"),
        (["bench", "--target", str(target), "--eagle", str(tmp_path / "file.txt")], "--eagle: is not a directory"),
        (["serve", "--target", str(tmp_path / "nope")], "--target: does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)


@pytest.mark.parametrize("argv", [["generate", "--threads", "0"], ["generate", "--max-batch", "-1"], ["serve", "--page-size", "0"],
                                  ["bench", "--target", ".", "--num-prompts", "0"], ["convert", "--target", ".", "--out", "o", "--tp", "0"],
                                  ["generate", "--tp-timeout", "0"]])
def test_counts_below_one_are_refused_by_the_parser_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    flag = next(a for a in argv if a.startswith("--") and a not in ("--target", "--out"))
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_every_flag_of_every_subcommand_has_help_and_shows_its_default(capsys):
    import argparse

    from dflash_trt.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings)
        text = p.format_help()
        for action in p._actions:  # a flag with a real default says it in --help
            if not any(action.default is v for v in (None, False, argparse.SUPPRESS)) and action.help and "(default" not in action.help:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.option_strings)
        assert "(default: None)" not in text and "(default: False)" not in text, name
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    from dflash_trt import __version__

    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dflash-trt {__version__}"


def test_the_statistics_line_ends_with_why_the_requests_stopped(tiny_dirs, capsys):
    target, drafter = tiny_dirs
    rc, _, err = _run(capsys, "--target", target, "--no-drafter", "--prompt", "a", "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0 and err.rstrip().endswith("finish=length")
    # EOS: the tiny target's eos id 2, reached by greedy decoding of some prompt within 64 tokens, or not; the
    # line names whichever happened, per request, and its count matches the per-request reasons printed above
    rc, out, err = _run(capsys, "--target", target, "--no-drafter", "--prompt", "a", "--prompt", "b", "--max-new-tokens", 64)
    reasons = [line.split("(")[1].split(",")[0] for line in out.splitlines() if line.startswith("--- [")]
    want = reasons[0] if len(set(reasons)) == 1 else ",".join(f"{r}:{reasons.count(r)}" for r in sorted(set(reasons)))
    assert rc == 0 and err.rstrip().endswith(f"finish={want}")


def test_progress_off_a_terminal_is_one_line_per_update():
    import io

    from dflash_trt.progress import progress_bar

    buf = io.StringIO()  # not a tty, like stderr redirected to a file
    with progress_bar(total=3, desc="work", file=buf, mininterval=0, miniters=1, delay=0) as bar:
        for _ in range(3):
            bar.update()
    text = buf.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) >= 3 and all(line.startswith("work:") for line in lines) and "3/3" in lines[-1]
    quick = io.StringIO()
    with progress_bar(total=3, desc="quick", file=quick) as bar:  # done within the default delay: silent
        bar.update(3)
    assert quick.getvalue() == ""


def test_a_d2t_outside_the_target_vocabulary_is_refused_at_load(tiny_dirs, tmp_path, capsys):
    from conftest import write_drafter

    target, _ = tiny_dirs
    drafter = write_drafter(tmp_path / "d", target, draft_vocab_size=8)
    state = load_file(drafter / "model.safetensors")
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[5] = 10_000  # draft token 5 -> target id 10005, past a 96-token vocabulary
    state["d2t"] = d2t
    save_file(state, drafter / "model.safetensors")
    rc, _, err = _run(capsys, "--target", target, "--drafter", drafter, "--prompt", "x", "--max-new-tokens", 2)
    assert rc == 2 and err.count("\n") == 1
    assert f"{drafter}: d2t: draft token 5 maps to target id 10005" in err and "1 of 8 entries" in err
