"""attention_mask in run.model, logprobs and hidden_states, against transformers.

Rows padded on the left and on the right, as an RL loop's batches of prompts and completions
come: at every token the mask keeps, the logits, log-probabilities and hidden states equal
transformers' given the same attention_mask and position_ids = attention_mask.cumsum(-1) - 1
(1e-6 relative: transformers computes its rotary tables in float32). A mask with padding
between a row's tokens, of another shape, or beside document_offsets raises fsdpp.Error.

usage: check_attention_mask.py FIXTURE_DIR WORK_DIR
"""
import os
import sys

import torch

from check_python_run import FIRST_STEP_BOUND, fresh_dir, refusal, write_run_file


def padded_rows(vocab):
    """input_ids [4, 10] and their mask: two rows padded on the left, one on the right, one full."""
    ids = torch.randint(vocab, (4, 10), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :7] = 0
    mask[2, 6:] = 0
    return ids, mask


def gap_at_tokens(got, want, mask):
    kept = mask.bool()
    return ((got[kept] - want[kept]).norm() / want[kept].norm()).item()


def main():
    import fsdpp
    from transformers import AutoModelForCausalLM
    fixtures, work = sys.argv[1], sys.argv[2]
    model_dir = os.path.join(fixtures, "llama_untied")
    run = fsdpp.Run(write_run_file(fresh_dir(work), model_dir), {"policy.options.fused_linear_logprob": True})
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ids, mask = padded_rows(run._run.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = reference(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        want_logp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        gaps = {"logits": gap_at_tokens(run.model(ids, attention_mask=mask), out.logits, mask),
                "hidden states": gap_at_tokens(run.model.hidden_states(ids, attention_mask=mask),
                                               out.hidden_states[-1], mask),
                # a target's log-probability is read where both it and the token before it are kept
                "log-probabilities": gap_at_tokens(run.model.logprobs(ids[:, :-1], ids[:, 1:],
                                                                      attention_mask=mask[:, :-1]),
                                                   want_logp, mask[:, :-1] * mask[:, 1:])}
    ok = max(gaps.values()) <= FIRST_STEP_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} left- and right-padded rows against transformers' attention_mask: " +
          ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()) + f" (bound {FIRST_STEP_BOUND:.0e}, relative)")
    holed = mask.clone()
    holed[3, 4] = 0
    for name, call, wanted in [
            ("padding between tokens", lambda: run.model(ids, attention_mask=holed), "row 3 has padding between"),
            ("another shape", lambda: run.model(ids, attention_mask=mask[:, :5]), "expected input_ids' shape"),
            ("not 0 or 1", lambda: run.model(ids, attention_mask=mask * 2), "expected 1 for a token and 0"),
            ("beside document_offsets", lambda: run.model(ids, attention_mask=mask,
                                                          document_offsets=torch.tensor([0, 40])), "not both")]:
        said = refusal(call)
        refused = wanted in said
        ok &= refused
        print(f"{'ok  ' if refused else 'FAIL'} a mask {name}: {said}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
