"""Named constants shared across layers: the one default timeout and the seed salts.

A salt separates two random streams that derive from the same run seed, so that changing
one (say, how nodes are shuffled) never shifts another (which minibatches a node draws).
Their values are fixed forever: changing one changes every result that depends on it.
"""

DEFAULT_TIMEOUT_S = 600.0   # every bounded wait: a collective, a rendezvous, a local launch

SAMPLER_SALT = 1009         # node i draws its minibatches from seed * SAMPLER_SALT + i
DEV_SPLIT_SALT = 0x5EED     # the dev split shuffles each node's examples with Random(seed ^ DEV_SPLIT_SALT)
PRESCREEN_SALT = 777000     # prescreening rollouts sample with seed + PRESCREEN_SALT
LSQ_SALT = 100003           # the least-squares problem's node i is drawn from seed * LSQ_SALT + i
