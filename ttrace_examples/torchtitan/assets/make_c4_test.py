"""Writes c4_test/data.json: 240 English-like documents (JSON lines, one {"text": ...} each), drawn
from a fixed word list with a fixed seed, in the shape of torchtitan's `c4_test` dataset. The wheel
of torchtitan 0.3.0 ships neither its tests/assets/c4_test nor its test tokenizer, and the hub is out
of reach: this file stands in for the data, and make_tokenizer.py trains tokenizer/ on it.

    python ttrace_examples/torchtitan/assets/make_c4_test.py    # rewrites c4_test/data.json
    python ttrace_examples/torchtitan/assets/make_tokenizer.py  # then the tokenizer trained on it
"""

import json
import random
from pathlib import Path

WORDS = """the of and to in a is that for it as was with be by on not he this are or his from at which
but have an they you were her she there had been one all we their has would when if so no will can more
out some what up into them then other than about only its time these two may first any like my now over
such our man me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three""".split()


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).parent / "c4_test" / "data.json"
    with out.open("w") as file:
        for _ in range(240):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 320)))
            file.write(json.dumps({"text": text.capitalize() + "."}) + "\n")


if __name__ == "__main__":
    main()
