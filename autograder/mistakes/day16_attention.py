"""Day 16 mistakes: each must lose its exercise's points."""

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------ online softmax update
    Mistake("online_softmax_update", "forgets to rescale the running sum", """
def online_softmax_update(m, l, chunk):
    m_new = torch.maximum(m, chunk.max(dim=-1).values)
    l_new = l + torch.exp(chunk - m_new[..., None]).sum(dim=-1)
    return m_new, l_new
"""),
    Mistake("online_softmax_update", "rescales with exp(m_new - m) (the inverse factor)", """
def online_softmax_update(m, l, chunk):
    m_new = torch.maximum(m, chunk.max(dim=-1).values)
    l_new = l * torch.exp(m_new - m) + torch.exp(chunk - m_new[..., None]).sum(dim=-1)
    return m_new, torch.nan_to_num(l_new)
"""),
    Mistake("online_softmax_update", "subtracts the block's own max, not the running one", """
def online_softmax_update(m, l, chunk):
    c = chunk.max(dim=-1).values
    m_new = torch.maximum(m, c)
    l_new = l * torch.exp(m - m_new) + torch.exp(chunk - c[..., None]).sum(dim=-1)
    return m_new, l_new
"""),
    # ------------------------------------------------------------ tile step
    Mistake("tile_step", "rescales l but not the accumulator", """
def tile_step(m, l, acc, s, v_blk):
    m_new = torch.maximum(m, s.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=-1), acc + p @ v_blk
"""),
    Mistake("tile_step", "normalises each tile on its own and adds them", """
def tile_step(m, l, acc, s, v_blk):
    m_new = torch.maximum(m, s.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=-1), acc * alpha[:, None] + torch.softmax(s, -1) @ v_blk
"""),
    Mistake("tile_step", "forgets to rescale the running sum", """
def tile_step(m, l, acc, s, v_blk):
    m_new = torch.maximum(m, s.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l + p.sum(dim=-1), acc * alpha[:, None] + p @ v_blk
"""),
    Mistake("tile_step", "no running max: exp of the raw scores (overflows for large scores)", """
def tile_step(m, l, acc, s, v_blk):
    p = torch.exp(s)
    return m, l + p.sum(dim=-1), acc + p @ v_blk
""", says="exp(100) is inf in float32"),
    # ------------------------------------------------------------ traffic
    Mistake("tiled_traffic", "floor division: a short last query block is not counted", """
def tiled_traffic(tq, tk, d, block_q, bytes_per_element):
    return (2 * tq * d + (tq // block_q) * 2 * tk * d) * bytes_per_element
"""),
    Mistake("tiled_traffic", "reads K but forgets V", """
def tiled_traffic(tq, tk, d, block_q, bytes_per_element):
    return (2 * tq * d + math.ceil(tq / block_q) * tk * d) * bytes_per_element
"""),
    Mistake("tiled_traffic", "reads K and V only once (as if they stayed in fast memory)", """
def tiled_traffic(tq, tk, d, block_q, bytes_per_element):
    return (2 * tq * d + 2 * tk * d) * bytes_per_element
"""),
    Mistake("tiled_traffic", "counts elements, not bytes", """
def tiled_traffic(tq, tk, d, block_q, bytes_per_element):
    return 2 * tq * d + math.ceil(tq / block_q) * 2 * tk * d
"""),
    # ------------------------------------------------------------ slot mapping
    Mistake("slot_of", "uses the logical block index as the physical block", """
def slot_of(table, position, block_size):
    if position < 0 or position >= len(table) * block_size:
        raise ValueError(f"position out of range: {position}")
    return position // block_size, position % block_size
"""),
    Mistake("slot_of", "off by one at the end of the table (allows position == capacity)", """
def slot_of(table, position, block_size):
    if position < 0 or position > len(table) * block_size:
        raise ValueError(f"position out of range: {position}")
    return table[min(position // block_size, len(table) - 1)], position % block_size
"""),
    Mistake("slot_of", "no check for a negative position", """
def slot_of(table, position, block_size):
    if position >= len(table) * block_size:
        raise ValueError(f"position out of range: {position}")
    return table[position // block_size], position % block_size
"""),
    Mistake("slot_of", "ValueError that does not name the position", """
def slot_of(table, position, block_size):
    if position < 0 or position >= len(table) * block_size:
        raise ValueError("out of range")
    return table[position // block_size], position % block_size
""", says="names `position`"),
    Mistake("slot_of", "logical block position // len(table) (the table's length, not block_size)", """
def slot_of(table, position, block_size):
    if position < 0 or position >= len(table) * block_size:
        raise ValueError(f"position must be in [0, {len(table) * block_size}), got {position}")
    return table[position // len(table)], position % block_size
""", says="logical block is position // block_size"),
    # ------------------------------------------------------------ blocks for an append
    Mistake("new_blocks", "ceil(n_new / block_size): ignores the room left in the last block", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if length < 0 or n_new < 0 or block_size < 1:
        raise ValueError("bad arguments")
    needed = math.ceil(n_new / block_size)
    if n_new > 0 and length % block_size != 0 and last_block_shared:
        needed += 1
    return needed
"""),
    Mistake("new_blocks", "no copy-on-write block for a shared partly filled last block", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if length < 0 or n_new < 0 or block_size < 1:
        raise ValueError("bad arguments")
    return math.ceil((length + n_new) / block_size) - math.ceil(length / block_size)
"""),
    Mistake("new_blocks", "copies a shared last block even when it is full", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if length < 0 or n_new < 0 or block_size < 1:
        raise ValueError("bad arguments")
    needed = math.ceil((length + n_new) / block_size) - math.ceil(length / block_size)
    if n_new > 0 and last_block_shared:
        needed += 1
    return needed
"""),
    Mistake("new_blocks", "copies the shared block even for an append of 0 tokens", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if length < 0 or n_new < 0 or block_size < 1:
        raise ValueError("bad arguments")
    needed = math.ceil((length + n_new) / block_size) - math.ceil(length / block_size)
    if length % block_size != 0 and last_block_shared:
        needed += 1
    return needed
"""),
    Mistake("new_blocks", "length // block_size blocks held (a partial block counted as free)", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if length < 0 or n_new < 0 or block_size < 1:
        raise ValueError("bad arguments")
    needed = math.ceil((length + n_new) / block_size) - length // block_size
    if n_new > 0 and length % block_size != 0 and last_block_shared:
        needed += 1
    return needed
"""),
    Mistake("new_blocks", "no ValueError for bad arguments", """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    needed = math.ceil((length + n_new) / max(block_size, 1)) - math.ceil(length / max(block_size, 1))
    if n_new > 0 and length % max(block_size, 1) != 0 and last_block_shared:
        needed += 1
    return needed
"""),
    # ------------------------------------------------------------ reference counts
    Mistake("release_block", "frees the block on every release (reuses a block a shared prefix "
            "still holds)", """
def release_block(refcount, free, block):
    if refcount[block] < 1:
        raise ValueError(f"block {block} is not allocated")
    refcount[block] -= 1
    free.append(block)
"""),
    Mistake("release_block", "sets the count to zero instead of decrementing", """
def release_block(refcount, free, block):
    if refcount[block] < 1:
        raise ValueError(f"block {block} is not allocated")
    refcount[block] = 0
    free.append(block)
"""),
    Mistake("release_block", "no double-free check", """
def release_block(refcount, free, block):
    refcount[block] -= 1
    if refcount[block] == 0:
        free.append(block)
"""),
    Mistake("release_block", "decrements before the double-free check (a refused call leaves -1)",
            """
def release_block(refcount, free, block):
    refcount[block] -= 1
    if refcount[block] < 0:
        raise ValueError(f"block {block} is not allocated (double free)")
    if refcount[block] == 0:
        free.append(block)
""", says="check for the double free before changing anything"),
    Mistake("release_block", "ValueError that does not name the block", """
def release_block(refcount, free, block):
    if refcount[block] < 1:
        raise ValueError("double free")
    refcount[block] -= 1
    if refcount[block] == 0:
        free.append(block)
""", says="naming the block"),
    Mistake("release_block", "works on copies of the lists and returns them", """
def release_block(refcount, free, block):
    if refcount[block] < 1:
        raise ValueError(f"block {block} is not allocated (double free)")
    refcount, free = list(refcount), list(free)
    refcount[block] -= 1
    if refcount[block] == 0:
        free.append(block)
    return refcount, free
""", says="changes the caller's lists in place"),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "thinks the rescale is only for stability", 'answer_q1 = "D"\n'),
    Mistake("q2", "counts used positions instead of empty ones", "answer_q2 = 100\n"),
    Mistake("q3", "writes into the shared block", 'answer_q3 = "A"\n'),
]

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('tile_step', 'FlashAttention-2 style: tile-local max, then combine', """
def tile_step(m, l, acc, s, v_blk):
    m_t = s.max(dim=-1).values
    p = torch.exp(s - m_t[:, None])
    l_t = p.sum(-1)
    acc_t = p @ v_blk
    m_new = torch.maximum(m, m_t)
    a, b = torch.exp(m - m_new), torch.exp(m_t - m_new)
    return m_new, l * a + l_t * b, acc * a[:, None] + acc_t * b[:, None]
"""),
    Alternative('online_softmax_update', 'logaddexp', """
def online_softmax_update(m, l, chunk):
    m_new = torch.maximum(m, chunk.max(-1).values)
    log_l = torch.logaddexp(torch.log(l) + m, torch.logsumexp(chunk, -1))
    return m_new, torch.exp(log_l - m_new)
"""),
    Alternative('tile_step', 'einsum, float64', """
def tile_step(m, l, acc, s, v_blk):
    m_new = torch.maximum(m, s.amax(-1))
    scale = (m - m_new).exp()
    p = (s.double() - m_new.double()[:, None]).exp()
    acc = acc * scale[:, None] + torch.einsum('qk,kd->qd', p, v_blk.double()).float()
    return m_new, l * scale + p.sum(-1).float(), acc
"""),
    Alternative('tiled_traffic', 'loop over query blocks', """
def tiled_traffic(tq, tk, d, block_q, bytes_per_element):
    total = 0
    for q0 in range(0, tq, block_q):
        rows = min(block_q, tq - q0)
        total += 2 * rows * d + 2 * tk * d
    return total * bytes_per_element
"""),
    Alternative('slot_of', 'divmod', """
def slot_of(table, position, block_size):
    if not 0 <= position < block_size * len(table):
        raise ValueError(f"position {position} is outside the table's {len(table)} blocks")
    b, off = divmod(position, block_size)
    return table[b], off
"""),
    Alternative('new_blocks', 'integer ceil', """
def new_blocks(length, n_new, block_size, last_block_shared=False):
    if min(length, n_new) < 0 or block_size < 1:
        raise ValueError("negative length/n_new or block_size < 1")
    held = (length + block_size - 1) // block_size
    need = (length + n_new + block_size - 1) // block_size
    extra = 1 if (last_block_shared and n_new and length % block_size) else 0
    return need - held + extra
"""),
    Alternative('release_block', 'extend free, <= 0 check', """
def release_block(refcount, free, block):
    if refcount[block] <= 0:
        raise ValueError(f"double free of block {block}")
    refcount[block] = refcount[block] - 1
    if not refcount[block]:
        free.extend([block])
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy int64 from np.ceil', '''
# Set answer_q2 to a number.
import numpy as np
answer_q2 = np.int64(np.ceil(100 / 16)) * 16 - 100
'''),
]

EQUIVALENT_MUTANTS: dict[str, str] = {}
