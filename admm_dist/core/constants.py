"""Named constants shared across layers: the one default timeout, the seed salts and the ceilings.

A salt separates two random streams that derive from the same run seed, so that changing
one (say, how nodes are shuffled) never shifts another (which minibatches a node draws).
Their values are fixed forever: changing one changes every result that depends on it.
"""

DEFAULT_TIMEOUT_S = 600.0   # every bounded wait: a collective, a rendezvous, a local launch

SAMPLER_SALT = 1009         # node i draws its minibatches from seed * SAMPLER_SALT + i
DEV_SPLIT_SALT = 0x5EED     # the dev split shuffles each node's examples with Random(seed ^ DEV_SPLIT_SALT)
PRESCREEN_SALT = 777000     # prescreening rollouts sample with seed + PRESCREEN_SALT
LSQ_SALT = 100003           # the least-squares problem's node i is drawn from seed * LSQ_SALT + i

# Ceilings of the settings that size memory or work. A value above one is refused in one
# line when the configuration is checked, before anything is allocated: each is generous for every
# shipped config, test and benchmark, and well below what exhausts a machine. The settings that the
# model bounds are checked against it instead, before the adapter is built (model/adapter.py):
# lora_rank against the smallest dimension of the projections it adapts, lora_layers_last against
# the backbone's layers. batch_size is not bounded by a node's examples: a node with fewer repeats
# them within a batch (its help says so), which small on-policy collections rely on.
MAX_AGENTS = 64             # n_agents: seats of a chain (no role or prompt limits it; each seat reads
                            # the upstream)
MAX_NODES = 64              # n_partitions: ADMM nodes, each holding x, z, u and Adam's moments
MAX_OPS = 16                # n_ops: operations per chain_arith / word_arith problem
MAX_QUERIES = 100_000       # anchors, anchor_pool, recollect_anchors, gen_chunk: queries of one collection
MAX_SAMPLES = 1024          # group, prefix_samples: rollouts per query
MAX_TOKENS = 1 << 20        # max_new_tokens, sink_tokens, max_prompt_tokens, max_target_tokens,
                            # vllm_max_model_len
MAX_GEN_BATCH = 1 << 16     # gen_batch_size: rows per generate call
MAX_ROUNDS = 100_000        # k_outer, and the periods and counts in rounds: dev_every, checkpoint_every,
                            # recollect_every, keep_checkpoints
MAX_LOCAL_STEPS = 100_000   # local_steps: Adam steps per x-step
MAX_BATCH_SIZE = 4096       # batch_size: examples per local Adam step
MAX_GOSSIP_STEPS = 1024     # gossip_steps: mixing steps per z-step
MAX_TIMEOUT_S = 7 * 86400.0  # timeout_s: a week
MAX_KV_CACHE_GIB = 1024.0   # vllm_kv_cache_gib

# Ceilings of the files a run reads, checked while reading, before the content is parsed.
MAX_CONFIG_BYTES = 1 << 20          # a --config YAML file
MAX_CONFIG_DEPTH = 32               # nesting of its collections (a config is flat key: value pairs)
MAX_CONFIG_NODES = 10_000           # its values, an alias counted once per use (the expanded size)
MAX_FITSET_LINE_BYTES = 1 << 20     # one example line of a fit set (about 250k tokens of text)
MAX_FITSET_HEADER_BYTES = 64 << 20  # a fit set's header line (it lists every query key used)
