"""LoRA fine-tuning (peft) of a tiny transformers model under hmp, then merging the adapter.

Shows: the frozen base model and the LoRA adapters compute in bfloat16 where the lists say,
the adapter weights train in float32, and ``merge_and_unload()`` (peft's merge runs uncast
under hmp) bakes the float32 LoRA delta into float32 weights: the merged model computes what
the adapted one did. Nothing is downloaded: the model is built from a config.

Run:  python examples/lora_peft.py
Needs transformers and peft:  pip install transformers peft
"""

import torch

try:
    import peft
    import transformers
except ImportError as error:
    raise ImportError("this example needs Hugging Face transformers and peft: pip install transformers peft") from error

import hmp

VOCAB, LENGTH = 64, 16


def main():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=LENGTH,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj  # one adapted layer, to look at
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(
        f"trainable (LoRA) parameters: {sum(p.numel() for p in trainable)} of "
        f"{sum(p.numel() for p in model.parameters())}"
    )

    # a fixed batch of sequences that repeat a 4-token motif
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (16, 4), generator=g).repeat(1, LENGTH // 4)
    optimizer = torch.optim.AdamW(trainable, lr=2e-2)

    with hmp.converted():
        for step in range(30):
            out = model(input_ids=ids, labels=ids)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            if step % 10 == 0 or step == 29:
                print(f"step {step:2d}: loss {out.loss.item():.4f}")
        print(f"under hmp: logits {out.logits.dtype}, loss {out.loss.dtype}")
        lora_a = q_proj.lora_A["default"].weight
        print(f"LoRA weights: {lora_a.dtype}, their gradients: {lora_a.grad.dtype}")

        model.eval()
        with torch.no_grad(), hmp.disable_casts():
            # what the merge should give, in float32: W + scaling * B @ A
            expected = q_proj.base_layer.weight + q_proj.scaling["default"] * (
                q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight
            )
            adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()  # peft's merge runs uncast under hmp
        with torch.no_grad(), hmp.disable_casts():
            after_merge = merged(input_ids=ids).logits
        merged_weight = merged.model.layers[0].self_attn.q_proj.weight

    print(f"merged model: {type(merged).__name__}, weights {sorted({str(p.dtype) for p in merged.parameters()})}")
    print(
        f"merged q_proj weight vs W + scaling * B @ A in float32: max abs difference "
        f"{(merged_weight - expected).abs().max().item():.2e}"
    )
    print(
        f"float32 logits, adapter vs merged model: max abs difference {(adapted - after_merge).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()
