"""Compare run.sh's two lm-evaluation-harness runs answer by answer: each choice's log-likelihood and is-greedy
flag through dartspec's server against transformers' own, each item's acc / acc_norm, and each written answer."""

import json
import sys
from pathlib import Path


def samples(folder: Path, task: str = "dartspec_quiz") -> dict[int, dict]:
    newest = sorted(folder.rglob(f"samples_{task}_2*.jsonl"))[-1]
    return {s["doc_id"]: s for s in map(json.loads, newest.read_text().splitlines())}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("results"))
    served, hf = samples(out / "dartspec"), samples(out / "hf")
    assert served.keys() == hf.keys()
    diffs, greedy_same, acc_same, answers = [], 0, 0, 0
    for doc, a in served.items():
        b = hf[doc]
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            diffs.append(abs(float(ll_a) - float(ll_b)))
            greedy_same += greedy_a == greedy_b
            answers += 1
        acc_same += (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    mean = {k: sum(s[k] for s in served.values()) / len(served) for k in ("acc", "acc_norm")}
    ref = {k: sum(s[k] for s in hf.values()) / len(hf) for k in ("acc", "acc_norm")}
    print(f"items {len(served)}, answers scored {answers}")
    print(f"acc / acc_norm through dartspec serve: {mean['acc']:.4f} / {mean['acc_norm']:.4f}")
    print(f"acc / acc_norm on transformers (hf, fp32): {ref['acc']:.4f} / {ref['acc_norm']:.4f}")
    print(f"items with the same acc and acc_norm: {acc_same}/{len(served)}")
    print(f"answers with the same is_greedy: {greedy_same}/{answers}")
    print(f"log-likelihood |dartspec - transformers|: max {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}")
    served, hf = samples(out / "dartspec", "dartspec_quiz_gen"), samples(out / "hf", "dartspec_quiz_gen")
    written = {doc: (s["resps"][0][0], hf[doc]["resps"][0][0]) for doc, s in served.items()}
    differ = {doc: pair for doc, pair in written.items() if pair[0] != pair[1]}
    same = len(written) - len(differ)
    print(f"greedy answers (until a stop string) the same as transformers': {same}/{len(written)}")
    for doc, (a, b) in differ.items():
        print(f"  item {doc}: dartspec {a!r}, transformers {b!r}")


if __name__ == "__main__":
    main()
