"""Check lm-evaluation-harness's loglikelihoods from a pdserve server against transformers' own:
reads the samples file `lm_eval --log_samples` wrote, tokenizes each (context, continuation) as
lm-eval does (the whole text, then the continuation's tokens after the context's), and sums the
continuation's log-softmax over transformers' logits. Prints the largest difference and how many
`is_greedy` answers agree.

    .venv/bin/python scripts/lm_eval_compare.py \\
        lm-eval-out/smollm2-135m/samples_pdserve_mc_*.jsonl \\
        --tokenizer smollm2-tokenizer [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("samples", type=Path, help="a samples_<task>_*.jsonl of loglikelihood requests")
    p.add_argument("--tokenizer", required=True, help="the tokenizer folder lm_eval was given")
    p.add_argument("--model", default="smollm2-135m", help="the model the server served")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    hf = load_model(ModelConfig(model=args.model)).hf_model
    worst, n, same = 0.0, 0, 0
    for line in args.samples.read_text().splitlines():
        sample = json.loads(line)
        for call, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = call["arg_0"], call["arg_1"]
            whole = tok(context + continuation)["input_ids"]
            start = len(tok(context)["input_ids"])
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
            rows = logp[start - 1 : len(whole) - 1]
            want = torch.tensor(whole[start:])
            ll = float(rows.gather(1, want.unsqueeze(1)).sum())
            greedy = bool((rows.argmax(dim=-1) == want).all())
            got_ll, got_greedy = float(resp[0][0]), str(resp[0][1]) == "True"
            worst = max(worst, abs(got_ll - ll))
            n += 1
            same += got_greedy == greedy
    print(f"{n} loglikelihoods: largest |server - transformers| {worst:.2e}; "
          f"is_greedy the same in {same} of {n}")  # fmt: skip


if __name__ == "__main__":
    main()
