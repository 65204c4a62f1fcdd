"""Write a tiny random-weight Llama with a word-level tokenizer to a directory: a local model for trying the
vLLM examples offline (its output is gibberish; what it shows is kvferry loading the prompt's prefix).

    python examples/make_tiny_model.py /tmp/tiny-llama
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="directory to write the model and tokenizer to")
    path = parser.parse_args().path
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(VOCAB - 3))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    print(f"wrote a tiny Llama ({VOCAB} words w0..w{VOCAB - 4}) to {path}")


if __name__ == "__main__":
    main()
