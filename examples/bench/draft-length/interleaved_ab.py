import json, statistics, torch
torch.set_num_threads(2)
from dflash_trt.bench import Method, _run
from dflash_trt.loading import encode_prompt, generation_eos_ids, load_tokenizer
from dflash_trt.draft_length import StepCost
from dflash_trt.loading import load_target
from dflash_trt.loading import load_drafter
from dflash_trt.prompts import load_eval_prompts
from dflash_trt.torch_backend import TorchBackend
T="/root/.cache/dflash-trt/SmolLM2-135M-Instruct"; D="examples/drafters/smollm2-dflash-b16"
tok=load_tokenizer(T); eos=generation_eos_ids(T,tok)
target=load_target(T, dtype=torch.bfloat16); drafter=load_drafter(D, target.cfg, dtype=torch.bfloat16)
prompts=[encode_prompt(tok,p.text,chat=True) for p in load_eval_prompts("code", limit=4)]
cost=StepCost.from_json(json.load(open("/tmp/bench-auto/bench.json"))["setup"]["step_cost"])
ar=Method("ar", TorchBackend(target,None,num_pages=256)); auto=Method("dflash-auto", TorchBackend(target,drafter,num_pages=256), None, cost)
res={"ar":[], "dflash-auto":[]}
for r in range(3):
    for m in (ar, auto) if r % 2 == 0 else (auto, ar):
        outs, wall = _run(m, prompts, eos, 96, 1)
        res[m.name].append(sum(len(o.output_ids)-1 for o in outs)/sum(o.decode_s for o in outs))
        same = None
    print(r, {k: round(v[-1],1) for k,v in res.items()}, flush=True)
print("median decode tok/s", {k: round(statistics.median(v),1) for k,v in res.items()}, "ratio", round(statistics.median(res["dflash-auto"])/statistics.median(res["ar"]),3))
