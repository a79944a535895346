"""REALM pre-training configs.

Variants (pass as `configs/realm.py:<variant>`):
  smoke  tiny model, bundled sample corpus, CPU, a few minutes end to end.
  small  4 layers x 256 wide: a CPU/GPU development size (also used by benchmarks/).
  base   BERT-base and the paper's hyperparameters (Guu et al. 2020), for a TPU pod.
  squad  the learning recipe (experiments/squad_qa): SQuAD's 18,896 Wikipedia paragraphs (the
         team's ../shared copy, else SQuAD's own train-v1.1.json by URL, downloaded once),
         held-out articles, real bert-tiny weights (by hub id) in all three networks and the
         embedders warm-started by ICT (`configs/ict.py:squad` first); under an hour on 2 CPUs.
  own    the recipe for your corpus (`--config.data.corpus=FILE`, no default: prepare names the
         field when it is missing): the squad recipe's sizes and bert-tiny reader, the
         retriever started from a trained sentence embedder (all-MiniLM-L6-v2 by hub id,
         model.init_retriever_from) instead of ICT, and REALM adapting it to the corpus; then
         configs/orqa.py:own fine-tunes and answers with the hybrid retriever (README "On your
         own corpus"). Why: zero-shot on SQuAD's held-out questions MiniLM's recall@5 was 82.0%
         (BM25 82.8%, bert-tiny's ICT 26.8%), and in a world it never read REALM from it raised
         held-out recall@5 from 24.2% to 100% within 50 REALM steps
         (experiments/trusted_start).
  world  a generated knowledge world (`realm-jax world`, docs/tutorial.md): fictional people,
         one knowledge document each, and a separate pre-training text whose masked facts
         only that document holds; REALM's retriever learning to fetch it in minutes on a CPU.

Every field is overridable on the command line, e.g. `--config.train.lr=1e-4`; the config is
locked, so a misspelt key is an error.
"""

import ml_collections

from realm_jax import config as config_lib


def _bert(**kw) -> ml_collections.ConfigDict:
    """One BERT encoder's architecture (the embedders and the reader each have one)."""
    m = ml_collections.ConfigDict()
    m.hidden_size = 768  # transformer width
    m.num_layers = 12  # transformer layers
    m.num_heads = 12  # attention heads
    m.intermediate_size = 3072  # feed-forward width
    m.hidden_act = "gelu_new"  # gelu (erf), gelu_new (tanh approximation), relu
    m.max_position_embeddings = 512  # learned absolute positions
    m.type_vocab_size = 2  # segment ids
    m.layer_norm_eps = 1e-12  # LayerNorm epsilon in BERT
    m.dropout = 0.1  # BERT dropout (embeddings, attention, hidden) in training; 0 = off
    m.update(kw)
    return m


def _model(bert: dict, **kw) -> ml_collections.ConfigDict:
    """The three networks: `embedder` (query and document embedders) and `reader` each have
    their own architecture; the vocabulary and everything below are shared."""
    m = ml_collections.ConfigDict()
    m.embedder = _bert(**bert)  # query + document embedders (override as model.embedder.*)
    m.reader = _bert(**bert)  # the knowledge-augmented reader (model.reader.*)
    m.vocab_size = 30522  # WordPiece vocab (bert-base-uncased, shipped in realm_jax/assets)
    m.proj_size = 128  # retrieval projection (REALM: 128)
    m.proj_dropout = 0.1  # dropout on the retrieval projection in training (ORQA ict_model.py)
    m.span_hidden_size = 256  # ORQA span head width (fine-tuning only)
    m.max_span_width = 10  # longest answer span in wordpieces (fine-tuning only)
    m.reader_layer_norm_eps = 1e-3  # LayerNorm epsilon in the span head
    # The release's flag defaults to one shared embedder (train_realm.py share_embedders=True);
    # the paper writes Embed_input and Embed_doc apart, and so do we by default. The squad
    # recipe run both ways (experiments/squad_qa, step 400, held out): separate 0.257 retrieval
    # utility, 15.7% same-title hits; shared 0.217 and 20.2%. Neither wins outright yet.
    m.share_embedders = False  # one network embeds queries and documents
    m.dtype = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    m.remat = False  # rematerialise each layer in the backward pass (saves activation memory)
    m.remat_policy = "nothing"  # with remat, keep: nothing (layer inputs) or dots (matmul outputs)
    m.init_embedder_from = ""  # HF folder (RealmEmbedder / BertModel) for both embedders
    m.init_reader_from = ""  # HF folder (RealmKnowledgeAugEncoder / BertForMaskedLM)
    m.init_embedders_from_ict = ""  # ICT workdir (its newest checkpoint) or checkpoint folder
    m.init_from_realm = ""  # REALM workdir: all three networks from its newest checkpoint
    # A sentence-embedding model as the retriever's start (docs/reference.md "A sentence
    # embedder as the retriever"): a folder or hub id, e.g. sentence-transformers/
    # all-MiniLM-L6-v2, BAAI/bge-small-en-v1.5, intfloat/e5-small-v2. At config load it sets
    # model.embedder.* (its architecture), proj_size (= its width), and the five fields below
    # from the model's files and card; its BERT weights start both embedders.
    m.init_retriever_from = ""  # sentence-transformers folder or hub id for both embedders
    m.embedder_pooling = "realm"  # realm (pooler + projection + LayerNorm), mean or cls
    m.embedder_normalize = False  # L2-normalise the embeddings (cosine scores)
    m.query_prefix = ""  # text before every query, e.g. e5's "query: "
    m.doc_prefix = ""  # text before every block, e.g. e5's "passage: "
    m.retrieval_scale = 1.0  # retrieval score = scale x <q, d> (1: the release's inner product)
    # with init_from_realm: its span head too (a fine-tuning workdir's, e.g. a reading phase's;
    # pre-training never trains the span head, so by default it starts afresh, as in ORQA)
    m.init_span_head_from_realm = False  # init_from_realm brings its span head too
    m.update(kw)
    return m


VARIANTS = ("smoke", "small", "base", "squad", "own", "world")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    c = ml_collections.ConfigDict()
    c.variant = variant  # which variant this is (informational)
    c.task = "realm"  # what `train` runs: realm (pre-training) or ict (configs/ict.py)

    # ---------------------------------------------------------------- model
    if variant == "smoke":
        tiny = dict(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            intermediate_size=256,
            max_position_embeddings=256,
            dropout=0.0,
        )
        c.model = _model(tiny, span_hidden_size=32, max_span_width=5)
    elif variant == "small":
        c.model = _model(
            dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
            span_hidden_size=64,
        )
    elif variant == "world":  # bert-tiny in all three (a random-init model never learns there:
        # its ICT stays at ln(batch), docs/tutorial.md); the ICT warm start is set in _world
        tiny = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512)
        c.model = _model(
            dict(tiny, hidden_act="gelu", max_position_embeddings=512),
            init_embedder_from=config_lib.BERT_TINY,  # a hub id (or a folder): fetched once
            init_reader_from=config_lib.BERT_TINY,
        )
    elif variant == "squad":  # bert-tiny (config_lib.BERT_TINY, by hub id) in all three
        tiny = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512)
        c.model = _model(
            dict(tiny, hidden_act="gelu"),
            init_embedder_from=config_lib.BERT_TINY,
            init_reader_from=config_lib.BERT_TINY,
            init_embedders_from_ict="runs/squad-ict",
        )
    elif variant == "own":  # squad's bert-tiny reader; the embedders from the sentence embedder
        tiny = dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512)
        # model.embedder.* below are squad's; at load, model.init_retriever_from replaces them
        # (and proj_size, pooling, normalisation, scale) with MiniLM's (docs/reference.md "A
        # sentence embedder as the retriever"); its weights start both embedders, no ICT
        c.model = _model(
            dict(tiny, hidden_act="gelu"),
            init_reader_from=config_lib.BERT_TINY,
            init_retriever_from=config_lib.MINILM,
        )
    else:  # base: BERT-base x 3 at batch 512 fits a v3-64 slice only with remat and bf16
        # activations (`realm-jax plan --topology v3-64`; docs/benchmarks.md "Pod plan")
        c.model = _model({}, remat=True, dtype="bfloat16")

    # ---------------------------------------------------------------- data
    c.data = ml_collections.ConfigDict()
    c.data.corpus = "data/sample/corpus.jsonl"  # raw corpus: .jsonl, .tsv or a .txt folder
    c.data.sentences = ""  # raw pre-training text; "" = the corpus itself
    c.data.data_dir = ""  # prepared TFDS datasets; "" = <workdir>/data
    c.data.block_len = 288 if variant != "smoke" else 128  # wordpieces per block incl. specials
    c.data.query_len = 96 if variant != "smoke" else 48  # wordpieces per masked sentence
    c.data.max_predictions = 10  # masked wordpieces per sentence (longer spans are skipped)
    c.data.min_sentence_tokens = 5  # shorter sentences are dropped
    c.data.masking = "salient"  # salient (NER + dates) or random
    c.data.mask_mode = "salient"  # read time: salient (a data.masking span), random_span, uniform
    # "salient": runs of other modes scored on the same masks (the world study's mask arms)
    c.data.eval_mask_mode = ""  # held-out evaluation's masks; "" = data.mask_mode's
    c.data.ner_model = "en_core_web_sm"  # spaCy pipeline for salient spans
    c.data.random_span_max = 3  # longest random span in words (random masking)
    c.data.skip_bad_input = False  # skip and count malformed input instead of stopping
    c.data.worker_count = 0  # grain worker processes (0 = in-process)
    c.data.seed = 0  # shuffle seed (and the held-out split's hash)
    c.data.eval_fraction = 0.05  # share of titles (or doc ids) whose sentences are held out
    c.data.eval_split_key = "title"  # hold out by "title" (whole articles) or "doc_id"
    c.data.ner_processes = 1  # spaCy NER worker processes at prepare time (nlp.pipe n_process)
    # prepare's engine: "local" (in process, the corpus in memory), "beam" (Apache Beam,
    # streaming; DirectRunner with a worker per core unless --beam_runner/--beam_options
    # name another, e.g. Dataflow: tpu/README.md) or "auto" (Beam from beam_min_passages lines)
    c.data.engine = "auto"  # "auto", "local" or "beam" (above)
    c.data.beam_min_passages = 50_000  # auto: corpus lines from which Beam prepares
    c.data.beam_chunk_kb = 1024  # Beam: corpus KiB one worker reads and blocks at a time
    # Beam on a local runner (which holds a pipeline's data in memory): corpus KiB prepared per
    # round of pipelines, bounding memory; 0: the whole corpus at once. Other runners: ignored.
    c.data.beam_window_kb = 8192  # Beam, local runners: corpus KiB per round (above)
    c.data.beam_shard_records = 65536  # Beam, and release block records: records per shard file
    # release block records (blocks.tfr, block_records.npy) stream (data/release_prepare.py)
    c.data.release_chunk_blocks = 4096  # blocks per chunk: memory follows it, not the corpus

    # ---------------------------------------------------------------- mesh
    c.mesh = ml_collections.ConfigDict()
    c.mesh.axes = ("data", "model")  # mesh axis names
    c.mesh.shape = (-1, 1)  # sizes; -1 = all remaining devices
    c.mesh.fsdp = False  # shard parameters and optimizer state over 'data' too (FSDP)
    # The exact MIPS search (ops/mips.py): each device scores its index rows this many at a
    # time, a running top-k, so it holds [batch, chunk] float32 scores, never [batch, N/devices]
    # (6.8 GB a chip at the paper's scale on 4 chips). Ids as with the whole shard at once.
    c.mesh.mips_chunk = 65536  # index rows a device scores at once; 0 = its whole shard
    # XLA's persistent compilation cache (jax_compilation_cache_dir): a restart, a resumed
    # job or the next command on the same config loads its programs instead of compiling them
    # (minutes at base). A local folder per host, or a gs:// folder the hosts share; "" = off.
    # JAX_COMPILATION_CACHE_DIR, when set, wins (the tests share one cache that way).
    c.mesh.compilation_cache_dir = "~/.cache/realm-jax/xla"  # "" = no persistent cache
    # The block embeddings on device (index/embedding.py index_dtype): bfloat16 halves the index
    # (3.4 GB instead of 6.8 at the paper's scale); the search sums its products in float32.
    # Measured on clustered random data (tests/unit/test_index_dtypes.py): recall@10 of the
    # exact float32 top-10 0.989. The token table needs no field: uint16 ids when
    # model.vocab_size <= 65536, else int32.
    c.mesh.index_dtype = "float32"  # float32 or bfloat16

    # ---------------------------------------------------------------- train
    c.train = ml_collections.ConfigDict()
    c.train.batch_size = {"smoke": 8, "small": 32, "base": 512}.get(variant, 32)  # global batch
    c.train.num_candidates = 4 if variant == "smoke" else 8  # incl. the null doc (paper: 8)
    # The paper's batch of 512 in one micro-batch's memory (pretrain/step.py accumulated_grads).
    c.train.grad_accum = 1  # micro-batches a step's batch is split into, gradients summed
    steps = {"smoke": 100, "small": 2000, "base": 200_000}.get(variant, 2000)
    c.train.steps = steps  # optimizer steps
    # The release uses 3e-5 (BERT-base, 200k steps, up to 10k warmup). smoke's 1e-3 is for a
    # random-init 2 x 64 model over 100 steps: with the null document scored like any block,
    # its held-out retrieval entropy stays at 1.38 of ln 4 = 1.39 at step 100 (make smoke,
    # 2026-11-22), where the constant-score null document saw 1.098 -> 0.04 within 80 steps.
    lr = {"smoke": 1e-3, "small": 1e-4, "base": 3e-5}.get(variant, 1e-4)
    c.train.lr = lr  # peak LR (BERT AdamW)
    c.train.warmup_steps = 10 if variant == "smoke" else -1  # -1: min(1e4, max(100, steps/10))
    c.train.weight_decay = 0.01  # AdamW decay, not on LayerNorm or biases
    c.train.embedder_lr_scale = 1.0  # the embedders' LR relative to train.lr (release: 1)
    # the first N steps train the reader alone, the retriever frozen (a reader warm-up, not in
    # the release: REALM there starts from a BERT-base reader that already fills in blanks)
    c.train.embedders_frozen_steps = 0  # steps before the embedders train; 0 = from the start
    # those steps with a step of their own that takes the reader's gradient alone (the
    # embedders forward only: 1.4x faster at world's sizes, 2.9x with all-MiniLM-L6-v2's,
    # docs/benchmarks.md). Off by default until its effect on learning is measured: the clip
    # then sees the reader's norm alone, and the embedders unfreeze with empty Adam moments
    # (the full step fills them with the frozen steps' gradients), larger first updates.
    c.train.frozen_step = False  # the reader-only step for the frozen steps (above)
    # then their LR rises linearly from 0 over this many steps (a warmup of their own; the
    # schedule's warmup is long over when they start late). 0: their full LR at once
    c.train.embedders_warmup_steps = 0  # steps of the embedders' own warmup; 0 = none
    # the first N steps may retrieve the masked sentence's own block (the release always
    # excludes it, so that the retriever learns no trivial match), and a separate text's
    # sentence (data.sentences) gets the block of its document's title put among its
    # candidates: with the embedders frozen that long, a copying curriculum for the reader's
    # warm-up (the retriever learns nothing from it); at most embedders_frozen_steps
    c.train.own_block_steps = 0  # steps of the copying curriculum (above); 0 = none
    # The null document (candidate 0): "scored" as the release scores it, the empty block
    # embedded by the live document embedder like any block; or "fixed", its prior 1/K for
    # every query (no gradient), a deviation from the release that docs/tutorial.md measures:
    # a scored null document's one embedding can take every query's mass at once.
    c.train.null_doc = "scored"  # "scored" or "fixed" (above)
    # A second retriever's candidates (not in the release): BM25's top-m blocks for each masked
    # sentence (the sentence without its masked span as the query, the own block excluded;
    # computed once per prepared dataset and kept in <data_dir>/candidates/) join the dense
    # top num_candidates - 1, deduplicated, each embedded by the live document embedder and
    # scored by the query like the others, so REALM's prior and posterior cover them all:
    # its gradient can pull towards a block the dense retriever does not find yet. Held-out
    # evaluation stays dense-only. Needs data.mask_mode=salient. 0 = off (the release).
    c.train.bm25_candidates = 0  # BM25 blocks added to each query's candidates (above)
    # The copying curriculum for sentences cut from the corpus (not in the release; issue 46):
    # for the first N steps each masked sentence gets a block of its own article (never its own
    # block) that holds the masked span among its candidates, read as own_block_steps' document
    # block is (the reader reads it alone, and REALM's loss runs over the others); the blocks
    # are found once with BM25's candidates (<data_dir>/candidates/). Needs salient masks.
    c.train.article_block_steps = 0  # steps of that curriculum; 0 = none
    # In-batch negatives for REALM's retriever (not in the release; issue 46): each query's
    # prior is normalised over the other queries' retrieved candidates too (deduplicated, its
    # own block excluded); the reader still reads only its own K and takes the others as the
    # null document (pretrain/step.py with_outside): the batch's other blocks (other sentences'
    # BM25 blocks among them) are pushed down as in ICT while REALM's posterior ranks the own
    # candidates. With grad_accum, within each micro-batch.
    c.train.inbatch_negatives = False  # the prior over the batch's candidates (above)
    # The BM25-imitation term beside REALM's loss (not in the release; issue 46): the loss is
    # REALM's plus this weight times a contrastive loss with BM25's top block for the masked
    # sentence as the positive, ranked against the batch's candidate blocks (deduplicated, the
    # own block excluded; pretrain/step.py imitation_term), in the same jitted step: where the
    # dense retriever starts at chance and REALM's pull is as small as the prior on the right
    # block, imitation is meant to bring it among the candidates. Measured at batch 16 (both
    # studies' READMEs, issue 46): no better than the term alone, below ICT's start on SQuAD.
    # Needs train.bm25_candidates >= 1.
    c.train.imitation_weight = 0.0  # weight of the imitation term; 0 = off (the release)
    # its negatives: "candidates" (every candidate block of the batch: the dense hits, hard)
    # or "positives" (the batch's BM25 top blocks alone: the imitation control's loss)
    c.train.imitation_negatives = "candidates"  # "candidates" or "positives" (above)
    # False: REALM's loss trains the reader alone (stop_gradient on the retriever's scores),
    # the embedders learn from the imitation term only: the control for imitation_weight
    c.train.realm_retriever_grad = True  # REALM's gradient reaches the retriever (release)
    c.train.grad_clip = 1.0  # global norm clipping
    c.train.adam_b1 = 0.9  # Adam beta1
    c.train.adam_b2 = 0.999  # Adam beta2
    c.train.adam_eps = 1e-6  # Adam epsilon (BERT)
    c.train.mlm_vocab_chunk = 2048  # vocab rows per fused MLM softmax step; 0 all, -1 dense logits
    c.train.seed = 0  # parameter init seed
    c.train.log_every = 10 if variant != "base" else 100  # steps between console/TensorBoard logs
    c.train.checkpoint_every = 20 if variant == "smoke" else 500  # steps between orbax saves
    c.train.keep_checkpoints = 3  # checkpoints kept
    c.train.eval_every = 50 if variant == "smoke" else 500  # steps between held-out evals; 0 off
    eval_batch = {"smoke": 8, "base": 512}.get(variant, 32)  # base: divides a pod's devices
    c.train.eval_batch_size = eval_batch  # global batch of an evaluation
    c.train.eval_examples = 256 if variant == "smoke" else 1024  # held-out examples used (0 all)
    c.train.preemption_save = True  # save a checkpoint on SIGTERM before exiting
    # several processes: steps between the collective stop checks (and at every checkpoint)
    c.train.stop_check_every = 10  # a stop waits at most this many steps; 1 process: each step
    c.train.profile_steps = ""  # "A:B": a jax.profiler trace of steps A..B in tb/; "" = off
    c.train.max_nonfinite = 5  # non-finite steps in a row (skipped) before the run stops
    # The progress watchdog (watchdog.py): no step completed within the bound -> every
    # thread's stack to the log and exit 75, so a restart resumes. 0 = automatic: max(floor,
    # 20 x the mean step time, 3 x the longest gap between steps)
    c.train.stall_timeout_s = 0.0  # seconds without a completed step; 0 = automatic
    c.train.stall_floor_s = 300.0  # the automatic bound's floor (seconds)
    c.train.first_step_timeout_s = 3600.0  # compile + first step, evaluations, saves (seconds)
    c.train.record_example_ids = False  # append each step's example ids to example_ids.jsonl

    # ---------------------------------------------------------------- index refresh
    c.refresh = ml_collections.ConfigDict()
    # external (a refresh job), inprocess (the trainer re-embeds the whole corpus every
    # refresh.every steps) or amortized (1/refresh.every of it before every step: index/feed.py)
    c.refresh.mode = "external"  # external, inprocess or amortized (above)
    c.refresh.every = 20 if variant == "smoke" else 500  # inprocess/amortized: steps a refresh
    c.refresh.check_every = 10 if variant == "base" else 1  # external: steps between looks for
    # a newly published index (on a pod each look is one broadcast from process 0)
    c.refresh.keep = 3  # index versions kept by the refresher
    # external: the trainer writes the document embedder alone (WORKDIR/embedder, ~1/9 of a
    # checkpoint) this often; the refresh job embeds with the newest export or checkpoint
    c.refresh.export_every = 0  # steps between exports; 0 = refresh.every; negative = none
    c.refresh.max_staleness = 4 * (20 if variant == "smoke" else 500)  # warn above this many steps
    # `local` restarts its refresh job when it exits or stays stopped (SIGSTOP) this long
    c.refresh.max_restarts = 3  # restarts of local's refresh job before the run stops
    c.refresh.stopped_grace_s = 30.0  # seconds a stopped refresh job is left before a restart
    c.refresh.embed_batch_size = 64 if variant == "smoke" else 512  # blocks per embedding call
    c.refresh.poll_seconds = 2.0  # how often the refresher looks for a new checkpoint
    # the trainer's wait for its first index: it gives up after this long without one AND
    # without progress from the refresh job (which reports after every part of the corpus)
    c.refresh.wait_seconds = 600.0  # seconds without an index or progress before giving up
    c.refresh.progress_every_blocks = 1_000_000  # refresh job: blocks a part (progress after each)
    # external: at every refresh.every steps the trainer waits for the index of that very
    # checkpoint (the refresh job embeds on other devices while the trainer stalls): the steps
    # equal inprocess mode's, staleness stays below refresh.every. False: the paper's
    # asynchronous refresh, the newest published version taken every check_every steps.
    c.refresh.lockstep = False  # needs train.checkpoint_every to divide refresh.every
    # external, not lockstep: each host reads its rows of a new version in a background thread
    # while the trainer keeps stepping; the swap happens at the first look (check_every) at
    # which every host has its rows (the trainer then waits only for the device copy).
    # False: read on the trainer's critical path at the look that finds the version.
    c.refresh.background_reads = True  # read a new version's rows beside the training steps
    # also serialise a ScaNN searcher with every index (host-side search for `ask`; the trainer
    # never uses it, and at 13M blocks it costs the refresh job minutes a version)
    c.refresh.build_scann = False  # build a ScaNN searcher with every published index
    c.refresh.scann_num_leaves = -1  # -1 = about sqrt(num_blocks)
    c.refresh.scann_leaves_to_search = -1  # -1 = about 5% of leaves (at least 10)
    c.refresh.scann_reorder = 100  # exact re-scoring of this many candidates
    if variant in ("squad", "own"):
        _squad(c)
    if variant == "own":
        _own(c)
    if variant == "world":
        _world(c)
    return c


def sweep(variant: str | None = None):
    """`realm-jax sweep`'s study (realm_jax/sweep/space.py). The world variant: a search over
    REALM's LR, the retriever's LR (relative) and the candidates, on held-out title recall@5
    (the masked fact's own document in the top 5), with median pruning once the embedders train;
    every other variant: the LR x candidates grid (override dicts)."""
    if variant == "world":
        from realm_jax.sweep import space

        return space.Search(
            params={
                "train.lr": space.log_uniform(1e-4, 2e-3),  # the reader's peak LR (recipe 5e-4)
                "train.embedder_lr_scale": space.log_uniform(0.02, 0.5),  # recipe 0.1
                "train.num_candidates": space.choice([8, 16]),  # recall@5 needs K - 1 >= 5
            },
            objective="eval/title_recall@5",
            direction="maximize",
            sampler="tpe",
            pruner="median",
            # the embedders are frozen for 200 steps (the same retriever in every trial until
            # then): the first decision at the evaluation of step 250, against 2 complete trials
            pruner_args={"n_startup_trials": 2, "n_warmup_steps": 250},
            trials=12,
            seed=0,
        )
    return [
        {"train.lr": lr, "train.num_candidates": k} for lr in (5e-5, 1e-4, 3e-4) for k in (4, 8)
    ]


def _squad(c: ml_collections.ConfigDict) -> None:
    """The squad recipe's sizes: 2-CPU friendly, every number chosen for an hour's budget."""
    c.data.corpus = config_lib.squad_files()[0]  # 18,896 paragraphs: ../shared's, else by URL
    c.data.data_dir = "runs/squad-data"  # shared by the ICT and REALM runs
    c.data.block_len = 192  # most paragraphs fit one block
    # The span head (fine-tuning only) is sized here so that a reading phase's trained head
    # (configs/orqa.py:squad_read) survives REALM pre-training into ORQA fine-tuning: ORQA's 256
    # is a third of BERT-base's width, bert-tiny is 128 wide (and at 256 the [spans, width]
    # activations dominated the step); 7.6% of SQuAD answers exceed 10 wordpieces, 2.9% 16.
    c.model.span_hidden_size = 64  # span head width (above)
    c.model.max_span_width = 16  # longest answer span in wordpieces (above)
    c.data.query_len = 64  # SQuAD sentences
    c.data.ner_processes = 2  # both cores for spaCy at prepare time
    c.train.batch_size = 16  # global batch
    c.train.steps = 400  # optimizer steps
    c.train.lr = 1e-4  # peak LR
    c.train.warmup_steps = 40  # linear warmup
    # bert-tiny's reader is weak at salient spans (0.4% at step 0), so the retriever's
    # gradient is noisy; at one LR the ICT-trained retriever lost same-article retrieval
    # (held-out same-title fraction 0.19 -> 0.04 by step 100) that a tenth of it keeps
    # (0.17): experiments/squad_qa has both runs.
    c.train.embedder_lr_scale = 0.1  # the embedders' LR relative to train.lr
    c.train.log_every = 10  # steps between logs
    c.train.checkpoint_every = 100  # steps between checkpoints
    c.train.eval_every = 100  # steps between held-out evaluations
    c.train.eval_batch_size = 32  # evaluation batch
    c.train.eval_examples = 512  # held-out sentences evaluated
    c.refresh.every = 100  # steps between in-process re-embeddings of the corpus
    c.refresh.embed_batch_size = 256  # blocks per embedding call
    c.refresh.mode = "inprocess"  # 2 CPU cores: re-embed between steps, no second process


def _own(c: ml_collections.ConfigDict) -> None:
    """The own-corpus recipe (README "On your own corpus"): squad's sizes (set before this) on
    the user's corpus, the retriever from model.init_retriever_from (set above), no ICT."""
    c.data.corpus = ""  # yours: --config.data.corpus=FILE (prepare stops naming this field)
    c.data.data_dir = ""  # "" = <workdir>/data; the README shares one across the stages
    # The index is re-embedded in process every 50 steps. A REALM step re-embeds its 16 x 8
    # candidate blocks with the live document embedder, forward and backward, so with MiniLM
    # (6 x 384) it costs about what re-embedding ~3 x 128 blocks does: on this 2-core CPU a
    # refresh of 1,000 blocks took 30 s at 48 wordpieces a block (experiments/trusted_start),
    # about 4x that at this recipe's 192, so a ~1,000-paragraph corpus (~1,100 blocks) costs
    # ~2.5 min a refresh against ~40 min of 50 steps: ~6% of training (every 20: ~15%). On
    # SQuAD's 18,896 paragraphs a refresh costs about as much as its 50 steps: raise it there.
    c.refresh.every = 50  # steps between in-process re-embeddings of the corpus (above)


def _world(c: ml_collections.ConfigDict) -> None:
    """The generated world (`realm-jax world` writes it into its --workdir; the data paths
    below expect runs/world) and the recipe that learns there (docs/tutorial.md): bert-tiny,
    the embedders warm-started by ICT (`configs/ict.py:world` into runs/world-ict), then a
    copying curriculum for the reader with the embedders frozen, then REALM."""
    w = c.world = ml_collections.ConfigDict()
    w.entities = 500  # people the pre-training text tells about (each one knowledge document)
    w.distractors = 500  # people with a knowledge document the text never mentions
    w.sentences_per_entity = 3  # pre-training sentences per person, one fact each
    # how a sentence names its person: "name", "attributes" (two other attributes, no name)
    # or "described" (as attributes, the profession in other words: BM25 misses)
    w.mention = "name"
    w.seed = 0  # the world's seed: the same seed, the same files
    w.shards = 2  # TFRecord shards of the pre-training text
    # "words": two ordinary vocab words ("Harbor Quill"), which bert-tiny's embeddings tell
    # apart; "made_up": syllables ("Chaenstur Coti"), several shared wordpieces a name, which
    # ICT from bert-tiny did not learn to match in 300 steps (held-out recall@5 0.6%)
    w.names = "words"  # "words" or "made_up" (above)
    c.data.corpus = "runs/world/corpus.jsonl"  # the knowledge documents
    c.data.sentences = "runs/world/text"  # REALM's annotated-shard format: spans given
    c.data.data_dir = "runs/world-data"  # shared by the ICT and REALM runs
    c.data.block_len = 48  # a knowledge document fits one block (the longest: 44)
    c.data.query_len = 24  # one sentence (the longest: 19)
    c.data.eval_fraction = 0.2  # a fifth of the people held out (their sentences, never trained)
    c.model.init_embedders_from_ict = "runs/world-ict"  # `ict --config configs/ict.py:world`
    t = c.train
    t.batch_size = 16  # global batch
    t.steps = 400  # optimizer steps
    t.lr = 5e-4  # peak LR (the reader's)
    t.warmup_steps = 20  # linear warmup
    # The recipe (docs/tutorial.md): for 100 steps the copying curriculum (the reader reads each
    # sentence's own document, and learns not to copy from the others); for 100 more the
    # reader reads what the frozen retriever retrieves; then REALM trains the retriever too.
    t.own_block_steps = 100  # the copying curriculum's steps
    t.embedders_frozen_steps = 200  # steps before the embedders train
    t.embedders_warmup_steps = 20  # then their own warmup
    # At the reader's LR the embedders lost ICT's retrieval within 50 steps (the documents'
    # embeddings, mean cosine 0.88 after ICT, all became one vector); at a tenth they learn
    # (docs/tutorial.md, "Why REALM collapsed")
    t.embedder_lr_scale = 0.1  # the embedders' LR relative to train.lr
    t.log_every = 20  # steps between logs
    t.checkpoint_every = 100  # steps between checkpoints
    t.eval_every = 50  # steps between held-out evaluations
    t.eval_batch_size = 32  # evaluation batch
    t.eval_examples = 256  # held-out sentences evaluated (of about 270)
    c.refresh.mode = "inprocess"  # re-embed the 1,000 blocks between steps (a second)
    c.refresh.every = 20  # steps between refreshes
    c.refresh.embed_batch_size = 256  # blocks per embedding call
