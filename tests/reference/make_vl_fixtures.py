# Writes tiny random Qwen2-VL and Qwen2.5-VL checkpoints plus reference logits computed by
# `transformers` for text-only, image, video, and image-plus-video batches, and the
# gradients of the last; the C++ parity test loads them. Run with the project venv:
#   .venv/bin/python tests/reference/make_vl_fixtures.py OUTDIR
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_cap  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

IMAGE, VIDEO, START, END = 290, 291, 292, 293
MERGE, PATCH, FRAMES, CHANNELS = 2, 4, 2, 3

TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            initializer_range=0.2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            bos_token_id=None, eos_token_id=None)  # Qwen's own ids lie past this vocabulary
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
              tie_word_embeddings=False, attn_implementation="eager")
PATCHING = dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=FRAMES, in_channels=CHANNELS,
                initializer_range=0.2)
# name -> (model class, config): a window of 16 pixels is 2 × 2 merge groups, so the 2 × 3
# groups of the first image fall into four windows, one of them empty after padding.
MODELS = {
    "qwen2_vl": (Qwen2VLForConditionalGeneration, Qwen2VLConfig(
        text_config=TEXT, vision_config=dict(depth=2, embed_dim=24, hidden_size=48, num_heads=3, mlp_ratio=2,
                                             **PATCHING), **TOKENS)),
    "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
        text_config=TEXT, vision_config=dict(depth=2, hidden_size=24, out_hidden_size=48, num_heads=3,
                                             intermediate_size=40, window_size=16, fullatt_block_indexes=[1],
                                             tokens_per_second=2, **PATCHING), **TOKENS)),
    # YaRN's attention factor on the multimodal rotation; the norm's epsilon left to the text
    # model's default, with another at the top of the file, which transformers ignores (EDITS).
    "qwen2_vl_yarn": (Qwen2VLForConditionalGeneration, Qwen2VLConfig(
        text_config={**{k: v for k, v in TEXT.items() if k != "rms_norm_eps"},
                     "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mrope_section": [1, 1, 2],
                                      "original_max_position_embeddings": 64}},
        vision_config=dict(depth=1, embed_dim=24, hidden_size=48, num_heads=3, mlp_ratio=2, **PATCHING), **TOKENS)),
}


def leak_text_keys(config):
    config["text_config"].pop("rms_norm_eps")
    config["rms_norm_eps"] = 0.5


# name -> a change made to the saved config.json, which transformers must read back to the
# same model.
EDITS = {"qwen2_vl_yarn": leak_text_keys}


def block(token, grid):
    """vision start, one placeholder per merged patch group, vision end"""
    t, h, w = grid
    return [START] + [token] * (t * h * w // MERGE ** 2) + [END]


def text(gen, n):
    return torch.randint(0, IMAGE, (n,), generator=gen).tolist()


def patches(gen, grids):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, CHANNELS * FRAMES * PATCH * PATCH, generator=gen)


def cases(gen):
    """name -> (input_ids [B, T], model kwargs)"""
    out = {"text": (torch.tensor([text(gen, 13), text(gen, 13)]), {})}
    # Two sequences with an image each, of different sizes; the text fills them to one length.
    grids = [(1, 4, 6), (1, 2, 4)]
    rows = [text(gen, 3) + block(IMAGE, grids[0]) + text(gen, 4),
            text(gen, 5) + block(IMAGE, grids[1]) + text(gen, 6)]
    out["image"] = (torch.tensor(rows), dict(pixel_values=patches(gen, grids), image_grid_thw=torch.tensor(grids)))
    video = [(2, 4, 4)]
    # 2 seconds per temporal patch: Qwen2.5-VL spaces the frames' positions by it.
    out["video"] = (torch.tensor([text(gen, 2) + block(VIDEO, video[0]) + text(gen, 3)]),
                    dict(pixel_values_videos=patches(gen, video), video_grid_thw=torch.tensor(video),
                         second_per_grid_ts=torch.tensor([2.0])))
    image, video = [(1, 2, 2)], [(2, 2, 4)]
    out["image_video"] = (torch.tensor([text(gen, 2) + block(IMAGE, image[0]) + text(gen, 2) + block(VIDEO, video[0])
                                        + text(gen, 3)]),
                          dict(pixel_values=patches(gen, image), image_grid_thw=torch.tensor(image),
                               pixel_values_videos=patches(gen, video), video_grid_thw=torch.tensor(video)))
    return out


def make_one(outdir, name, cls, config):
    out = os.path.join(outdir, name)
    torch.manual_seed(7)
    model = cls(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so skipping one shows
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    if name in EDITS:
        path = os.path.join(out, "config.json")
        with open(path) as f:
            saved = json.load(f)
        EDITS[name](saved)
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)
        if AutoConfig.from_pretrained(out).text_config.to_dict() != config.text_config.to_dict():
            sys.exit(f"make_vl_fixtures: transformers reads the edited {path} to another language model")
    reference = {}
    gen = torch.Generator().manual_seed(20240601)
    for case, (ids, kwargs) in cases(gen).items():
        if cls is Qwen2VLForConditionalGeneration:
            kwargs = {k: v for k, v in kwargs.items() if k != "second_per_grid_ts"}
        model.zero_grad()
        # Each token's modality (text 0, image 1, video 2), which transformers' processor returns
        # beside input_ids; fsdpp finds the placeholders itself.
        modality = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        result = model(input_ids=ids, labels=ids, mm_token_type_ids=modality, **kwargs)
        reference[f"{case}.input_ids"] = ids
        reference[f"{case}.logits"] = result.logits.detach().contiguous()
        for key, value in kwargs.items():
            reference[f"{case}.{key}"] = value.contiguous()
        if case == "image_video":
            result.loss.backward()
            reference[f"{case}.loss"] = result.loss.detach().reshape(())
            for n, p in model.named_parameters():
                # The saved files name the language model "model." and the tower "visual.".
                saved = n.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
                reference[f"grad.{saved}"] = p.grad.detach().clone()
        print(f"{name} {case}: input_ids {list(ids.shape)}, loss {result.loss.item():.6f}")
    save_file(reference, os.path.join(out, "reference.safetensors"))


def main():
    ap = argparse.ArgumentParser(description="Tiny Qwen2-VL and Qwen2.5-VL checkpoints and reference outputs.")
    ap.add_argument("outdir", metavar="OUTDIR")
    outdir = ap.parse_args().outdir
    for name, (cls, config) in MODELS.items():
        make_one(outdir, name, cls, config)


if __name__ == "__main__":
    main()
