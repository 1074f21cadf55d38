"""Writes tokenizer/tokenizer.json and tokenizer/tokenizer_config.json: a byte-level BPE trained with the
`tokenizers` library on c4_test/data.json (make_c4_test.py), for torchtitan's `HuggingFaceTokenizer`.

torchtitan reads tokenizer.json as is and takes its BOS and EOS from tokenizer_config.json's
`bos_token` / `eos_token` (its text dataset needs an EOS id, and adds BOS itself); both are special
tokens of the vocabulary, ids 0 and 1, so no id ever reaches the debug models' embedding size
(llama3 and qwen3 debug models: vocab_size 2048; this vocabulary is far smaller, as the text is drawn
from about 150 words). Training on one thread over a fixed file gives the same merges every time, and
the files are written in a fixed key order: rerunning rewrites them byte for byte.

    python ttrace_examples/torchtitan/assets/make_tokenizer.py    # after make_c4_test.py
"""

import json
import os
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its thread pool

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

ASSETS = Path(__file__).parent
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 2000
"""An upper bound under the debug models' 2048; the corpus's merges run out well before it."""


def trained_tokenizer(data: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """What torchtitan's HuggingFaceTokenizer reads: BOS and EOS, as special tokens with their ids."""
    special = {str(tokenizer.token_to_id(token)): {"content": token, "lstrip": False, "normalized": False,
                                                   "rstrip": False, "single_word": False, "special": True}
               for token in (BOS, EOS)}
    return {"added_tokens_decoder": special, "bos_token": BOS, "eos_token": EOS,
            "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}


def main() -> None:
    tokenizer = trained_tokenizer(ASSETS / "c4_test" / "data.json")
    out = ASSETS / "tokenizer"
    out.mkdir(exist_ok=True)
    tokenizer_json = json.loads(tokenizer.to_str())
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json, indent=1, ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
