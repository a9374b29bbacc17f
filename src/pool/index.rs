//! The in-memory index: key → slot, slot states, LRU order, pins, free slots.
//!
//! The index is the only thing that decides what is visible. A key enters it
//! when its store has committed (data and header durable) and leaves it when
//! evicted; a slot being written is `Reserved`, never readable. Evicting a key
//! frees its slot in memory at once, but the slot's old header stays on the
//! device until the next store into that slot invalidates it first, so the
//! index also remembers which free slots still carry a durable header.

use super::Key;
use crate::error::{Error, Result};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// A key's place in the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its slot.
    pub slot: u64,
    /// The store counter it was written under.
    pub generation: u64,
    /// Pins held by callers (`lookup_and_pin`).
    pub pins: u32,
    /// Pins held by the tier's own jobs (a load reading the block). Kept
    /// apart so a caller's stray `unpin` can never release them.
    pub job_pins: u32,
    /// LRU clock value of the last store or load.
    pub tick: u64,
}

impl Entry {
    /// Whether anything pins it (a caller or a job). Counts saturate at
    /// u32::MAX rather than wrap (4 billion pins of one key: the entry
    /// then stays pinned for good, which only costs its slot).
    pub fn pinned(&self) -> bool {
        self.pins > 0 || self.job_pins > 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Reserved,
    Live,
    /// Its sectors failed a write (or its header could not be read): never handed out.
    Bad,
    /// Its block failed verification and left the index; loads in flight still read
    /// it, so it is not free until the last of them finishes.
    Condemned,
}

/// Slots handed out for a store.
#[derive(Debug, Default)]
pub struct Allocation {
    /// The slots.
    pub slots: Vec<u64>,
    /// The subset of `slots` whose device header is still a live header of
    /// an evicted or stale block: it must be invalidated (and that made
    /// durable) before new data goes into the slot.
    pub needs_invalidate: Vec<u64>,
    /// Keys evicted to make room.
    pub evicted: Vec<Key>,
}

/// A pool's index behind its own lock, shared by the pool and the readers
/// that must never wait for the pool's I/O (a handle's `lookup_and_pin` and
/// `unpin`, while its I/O thread hashes a landed layer or plans a store).
/// Every holder keeps the lock for one index operation (or a few, never
/// across I/O or hashing), so a lookup waits at most for that.
///
/// Only the tier that owns the pool adds or removes keys (commit, evict,
/// condemn, abort); other holders read, pin and unpin. Pins and eviction
/// both happen under this lock, so a key pinned here is never evicted.
#[derive(Clone)]
pub struct SharedIndex(Arc<Mutex<Index>>);

impl SharedIndex {
    /// Share `index`.
    pub fn new(index: Index) -> Self {
        SharedIndex(Arc::new(Mutex::new(index)))
    }

    /// The index, locked. Hold the guard for index operations only: never
    /// across I/O, hashing or another lock of the same index (it is not
    /// reentrant).
    pub fn lock(&self) -> MutexGuard<'_, Index> {
        // A panic on another thread between two statements leaves the index
        // consistent: each method finishes its change before returning.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Key → slot, the free slots, pins and the LRU order of what may be evicted.
pub struct Index {
    map: HashMap<Key, Entry>,
    slots: Vec<SlotState>,
    stale_header: Vec<bool>,
    free: BTreeSet<u64>,
    /// Unpinned live entries, oldest first.
    lru: BTreeSet<(u64, u64)>,
    slot_key: HashMap<u64, Key>,
    tick: u64,
    cursor: u64,
    pinned: u64,
    bad: u64,
    /// Condemned slots: the job pins still reading them.
    condemned: HashMap<u64, u32>,
}

impl Index {
    /// An index of `total_slots` free slots.
    pub fn new(total_slots: u64) -> Self {
        Index {
            map: HashMap::new(),
            slots: vec![SlotState::Free; total_slots as usize],
            stale_header: vec![false; total_slots as usize],
            free: (0..total_slots).collect(),
            lru: BTreeSet::new(),
            slot_key: HashMap::new(),
            tick: 0,
            cursor: 0,
            pinned: 0,
            bad: 0,
            condemned: HashMap::new(),
        }
    }

    /// Slots in all.
    pub fn total_slots(&self) -> u64 {
        self.slots.len() as u64
    }
    /// Live blocks.
    pub fn live(&self) -> u64 {
        self.map.len() as u64
    }
    /// Slots free.
    pub fn free_slots(&self) -> u64 {
        self.free.len() as u64
    }
    /// Live blocks with at least one pin.
    pub fn pinned(&self) -> u64 {
        self.pinned
    }
    /// Slots reserved by stores in flight.
    pub fn reserved(&self) -> u64 {
        self.total_slots()
            - self.live()
            - self.free_slots()
            - self.bad
            - self.condemned.len() as u64
    }
    /// Slots retired because their sectors failed.
    pub fn bad_slots(&self) -> u64 {
        self.bad
    }
    /// Whether `slot` is retired.
    pub fn is_bad(&self, slot: u64) -> bool {
        self.slots.get(slot as usize) == Some(&SlotState::Bad)
    }

    /// Retire a free or reserved slot for good: its sectors fail, so no store may
    /// use it again. Its header is left as it is (it could not be written, or
    /// describes no block).
    pub fn retire(&mut self, slot: u64) {
        let s = slot as usize;
        match self.slots.get(s) {
            Some(SlotState::Free) => {
                self.free.remove(&slot);
            }
            Some(SlotState::Reserved) => {}
            _ => return,
        }
        self.slots[s] = SlotState::Bad;
        self.bad += 1;
    }

    /// Put a retired slot back in service (its header sector was rewritten
    /// and reads back): free, with a cleared header.
    pub fn reinstate(&mut self, slot: u64) {
        let s = slot as usize;
        if self.slots.get(s) != Some(&SlotState::Bad) {
            return;
        }
        self.slots[s] = SlotState::Free;
        self.stale_header[s] = false;
        self.free.insert(slot);
        self.bad -= 1;
    }

    /// A block failed verification: take its key out of the index at once so it
    /// is never served again. Returns its slot. The slot stays out of the free
    /// list while loads hold it (`release_condemned` once each finishes), then
    /// is free with its header marked stale unless `header_cleared`.
    pub fn condemn(&mut self, key: &Key, header_cleared: bool) -> Option<u64> {
        let e = self.map.remove(key)?;
        self.lru.remove(&(e.tick, e.slot));
        self.slot_key.remove(&e.slot);
        if e.pinned() {
            self.pinned -= 1;
        }
        self.stale_header[e.slot as usize] = !header_cleared;
        if e.job_pins > 0 {
            self.slots[e.slot as usize] = SlotState::Condemned;
            self.condemned.insert(e.slot, e.job_pins);
        } else {
            self.slots[e.slot as usize] = SlotState::Free;
            self.free.insert(e.slot);
        }
        Some(e.slot)
    }

    /// Take `key` out of the index because its owner asked (an engine that
    /// evicts by its own accounting, e.g. LMCache's L2 delete): it is never
    /// served again, and its slot is free once no load reads it (loads in
    /// flight finish reading it; a caller's pin goes with the key). The
    /// block's header stays on the device, marked stale, until the next
    /// store into the slot invalidates it, so a pool reopened before then
    /// may find the block again (still verified against its checksums).
    /// Returns its slot, or None if the key was not live.
    pub fn remove(&mut self, key: &Key) -> Option<u64> {
        self.condemn(key, false)
    }

    /// A load that held a condemned slot finished.
    pub fn release_condemned(&mut self, slot: u64) {
        let Some(n) = self.condemned.get_mut(&slot) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.condemned.remove(&slot);
            self.slots[slot as usize] = SlotState::Free;
            self.free.insert(slot);
        }
    }

    /// The entry of `key`.
    pub fn get(&self, key: &Key) -> Option<&Entry> {
        self.map.get(key)
    }

    /// The key in `slot`.
    pub fn key_of_slot(&self, slot: u64) -> Option<&Key> {
        self.slot_key.get(&slot)
    }

    /// Every live key and its entry.
    pub fn entries(&self) -> impl Iterator<Item = (&Key, &Entry)> {
        self.map.iter()
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Mark a key used now (loads keep hot prefixes resident).
    pub fn touch(&mut self, key: &Key) {
        let t = self.next_tick();
        if let Some(e) = self.map.get_mut(key) {
            if !e.pinned() {
                self.lru.remove(&(e.tick, e.slot));
                self.lru.insert((t, e.slot));
            }
            e.tick = t;
        }
    }

    /// How many leading keys are live. No side effects.
    pub fn lookup_prefix(&self, keys: &[Key]) -> usize {
        keys.iter().take_while(|k| self.map.contains_key(k)).count()
    }

    /// Like `lookup_prefix`, and pins (and touches) the keys it counts, in
    /// one step: a key counted is a key pinned, whatever evicts next.
    pub fn lookup_and_pin(&mut self, keys: &[Key]) -> usize {
        let n = self.lookup_prefix(keys);
        for k in &keys[..n] {
            self.pin(k);
            self.touch(k);
        }
        n
    }

    /// Like `lookup_and_pin`, and returns the generation of each entry it
    /// pinned: the names to unpin by (`unpin_entry`) for a caller that must
    /// never drop a pin on a later entry of the same key (a service's
    /// client, whose pinned key may be removed and stored anew while
    /// another client pins the new entry).
    pub fn lookup_and_pin_entries(&mut self, keys: &[Key]) -> Vec<u64> {
        let n = self.lookup_and_pin(keys);
        keys[..n].iter().map(|k| self.map[k].generation).collect()
    }

    /// Drop `n` caller pins of `key` (as many as it has, at most) if its
    /// entry is still the one stored under `generation`; a later entry's
    /// pins belong to whoever took them.
    pub fn unpin_entry(&mut self, key: &Key, generation: u64, n: u32) {
        if self.map.get(key).is_some_and(|e| e.generation == generation) {
            self.drop_pins(key, false, n);
        }
    }

    /// Pin a live key against eviction for a caller. False if the key is not live.
    pub fn pin(&mut self, key: &Key) -> bool {
        self.add_pin(key, false)
    }

    /// Drop one caller pin. Unknown or unpinned keys are ignored: unpin
    /// never fails, and never releases a job's pin.
    pub fn unpin(&mut self, key: &Key) {
        self.drop_pin(key, false)
    }

    /// Pin a live key for the duration of a job.
    pub fn pin_job(&mut self, key: &Key) -> bool {
        self.add_pin(key, true)
    }

    /// Drops a job's pin of `key`.
    pub fn unpin_job(&mut self, key: &Key) {
        self.drop_pin(key, true)
    }

    fn add_pin(&mut self, key: &Key, job: bool) -> bool {
        let Some(e) = self.map.get_mut(key) else {
            return false;
        };
        if !e.pinned() {
            self.lru.remove(&(e.tick, e.slot));
            self.pinned += 1;
        }
        if job {
            e.job_pins = e.job_pins.saturating_add(1);
        } else {
            e.pins = e.pins.saturating_add(1);
        }
        true
    }

    fn drop_pin(&mut self, key: &Key, job: bool) {
        self.drop_pins(key, job, 1)
    }

    fn drop_pins(&mut self, key: &Key, job: bool, n: u32) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        let count = if job { &mut e.job_pins } else { &mut e.pins };
        if *count == 0 || n == 0 {
            return;
        }
        *count = count.saturating_sub(n);
        if !e.pinned() {
            self.lru.insert((e.tick, e.slot));
            self.pinned -= 1;
        }
    }

    /// Reserve `n` slots, evicting least-recently-used unpinned blocks if the
    /// free slots do not suffice. Slots come in ascending order from a
    /// rotating cursor, so a fresh pool hands out whole runs of a group.
    pub fn allocate(&mut self, n: u64) -> Result<Allocation> {
        let free = self.free.len() as u64;
        if free + (self.lru.len() as u64) < n {
            return Err(Error::PoolFull {
                needed: n,
                free,
                pinned: self.pinned,
                reserved: self.reserved(),
                retired: self.bad,
            });
        }
        let mut evicted = Vec::new();
        while (self.free.len() as u64) < n {
            let (_, slot) = self.lru.pop_first().expect("counted above");
            let key = self.slot_key.remove(&slot).expect("live slot has a key");
            self.map.remove(&key);
            self.slots[slot as usize] = SlotState::Free;
            self.free.insert(slot);
            evicted.push(key);
        }
        let mut slots = Vec::with_capacity(n as usize);
        while (slots.len() as u64) < n {
            let next = self
                .free
                .range(self.cursor..)
                .next()
                .or_else(|| self.free.iter().next())
                .copied()
                .expect("enough free slots");
            self.free.remove(&next);
            self.slots[next as usize] = SlotState::Reserved;
            self.cursor = next + 1;
            slots.push(next);
        }
        let needs_invalidate = slots
            .iter()
            .copied()
            .filter(|&s| self.stale_header[s as usize])
            .collect();
        Ok(Allocation {
            slots,
            needs_invalidate,
            evicted,
        })
    }

    /// A reserved slot's old header has been durably invalidated.
    pub fn header_invalidated(&mut self, slot: u64) {
        self.stale_header[slot as usize] = false;
    }

    /// A slot's device header may be a live one (a store failed after its
    /// header write was issued): invalidate it before the slot is reused.
    pub fn mark_stale_header(&mut self, slot: u64) {
        self.stale_header[slot as usize] = true;
    }

    /// A store into a reserved slot is durable: make the key visible.
    pub fn commit(&mut self, key: Key, slot: u64, generation: u64) {
        debug_assert_eq!(self.slots[slot as usize], SlotState::Reserved);
        let t = self.next_tick();
        self.slots[slot as usize] = SlotState::Live;
        self.stale_header[slot as usize] = true;
        self.slot_key.insert(slot, key);
        self.lru.insert((t, slot));
        let old = self.map.insert(
            key,
            Entry {
                slot,
                generation,
                pins: 0,
                job_pins: 0,
                tick: t,
            },
        );
        debug_assert!(old.is_none(), "a key is stored once");
    }

    /// A store failed: its slot goes back to the free list. Its partial data
    /// is unreachable unless a header write landed before the failure; the
    /// caller marks the header stale when that may be (`mark_stale_header`).
    pub fn abort(&mut self, slot: u64) {
        debug_assert_eq!(self.slots[slot as usize], SlotState::Reserved);
        self.slots[slot as usize] = SlotState::Free;
        self.free.insert(slot);
    }

    /// Rebuild: a valid header found on the device. If the key is already
    /// present, the newer generation wins and the loser's slot is free with a
    /// stale header.
    pub fn load_header(&mut self, key: Key, slot: u64, generation: u64) {
        self.stale_header[slot as usize] = true;
        if let Some(old) = self.map.get(&key).copied() {
            if old.generation >= generation {
                return;
            }
            self.remove_live(&key);
        }
        self.free.remove(&slot);
        self.slots[slot as usize] = SlotState::Reserved;
        self.commit(key, slot, generation);
        self.stale_header[slot as usize] = true;
    }

    /// After a rebuild, order the LRU by generation (older stores first).
    pub fn order_lru_by_generation(&mut self) {
        let mut live: Vec<(u64, Key)> = self.map.iter().map(|(k, e)| (e.generation, *k)).collect();
        live.sort();
        self.lru.clear();
        self.tick = 0;
        for (_, key) in live {
            let t = self.next_tick();
            let e = self.map.get_mut(&key).expect("live");
            e.tick = t;
            self.lru.insert((t, e.slot));
        }
    }

    fn remove_live(&mut self, key: &Key) {
        if let Some(e) = self.map.remove(key) {
            self.lru.remove(&(e.tick, e.slot));
            self.slot_key.remove(&e.slot);
            self.slots[e.slot as usize] = SlotState::Free;
            self.free.insert(e.slot);
            if e.pinned() {
                self.pinned -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u64) -> Key {
        Key::from_u64(i)
    }

    #[test]
    fn pool_full_says_when_retired_slots_took_the_room() {
        let mut ix = Index::new(4);
        let e = ix.allocate(5).unwrap_err().to_string();
        assert!(e.contains("pool full") && !e.contains("retired"), "{e}");
        for s in 0..3 {
            ix.retire(s);
        }
        let e = ix.allocate(2).unwrap_err().to_string();
        assert!(
            e.contains("1 free") && e.contains("3 slot(s) retired") && e.contains("pool check"),
            "{e}"
        );
    }

    #[test]
    fn a_reinstated_slot_is_free_again_and_only_a_retired_one_is() {
        let mut ix = Index::new(4);
        ix.retire(2);
        assert_eq!((ix.free_slots(), ix.bad_slots()), (3, 1));
        assert!(ix.is_bad(2));
        ix.reinstate(2);
        assert_eq!((ix.free_slots(), ix.bad_slots()), (4, 0));
        assert!(!ix.is_bad(2));
        ix.reinstate(2);
        ix.reinstate(3);
        assert_eq!((ix.free_slots(), ix.bad_slots()), (4, 0), "no-ops");
        assert_eq!(ix.reserved(), 0);
    }

    fn store(ix: &mut Index, keys: &[u64]) -> Allocation {
        let a = ix.allocate(keys.len() as u64).unwrap();
        for (i, &s) in a.slots.iter().enumerate() {
            ix.commit(k(keys[i]), s, keys[i]);
        }
        a
    }

    #[test]
    fn fresh_allocation_is_consecutive() {
        let mut ix = Index::new(16);
        assert_eq!(store(&mut ix, &[1, 2, 3]).slots, vec![0, 1, 2]);
        assert_eq!(store(&mut ix, &[4, 5]).slots, vec![3, 4]);
        assert_eq!(ix.live(), 5);
        assert_eq!(ix.free_slots(), 11);
    }

    #[test]
    fn evicts_lru_and_skips_pinned() {
        let mut ix = Index::new(4);
        store(&mut ix, &[1, 2, 3, 4]);
        ix.touch(&k(1)); // 1 is now the most recent
        assert!(ix.pin(&k(2)));
        let a = store(&mut ix, &[5, 6]);
        assert_eq!(a.evicted, vec![k(3), k(4)]);
        assert_eq!(
            a.needs_invalidate.len(),
            2,
            "reused slots carry old headers"
        );
        assert!(ix.get(&k(3)).is_none() && ix.get(&k(1)).is_some() && ix.get(&k(2)).is_some());
        // Everything pinned: refuse with counts in the error.
        for key in [1, 5, 6] {
            ix.pin(&k(key));
        }
        let err = ix.allocate(1).unwrap_err().to_string();
        assert!(
            err.contains("pool full") && err.contains("4 stored block(s) pinned"),
            "{err}"
        );
        // A job pin survives a caller's stray unpins.
        assert!(ix.pin_job(&k(6)));
        ix.unpin(&k(6));
        ix.unpin(&k(6));
        assert_eq!(ix.get(&k(6)).unwrap().job_pins, 1);
        ix.unpin_job(&k(6));
        ix.pin(&k(6));
        // unpin never fails, even for unknown or unpinned keys.
        ix.unpin(&k(99));
        ix.unpin(&k(1));
        ix.unpin(&k(1));
        assert_eq!(ix.pinned(), 3);
        assert_eq!(ix.allocate(1).unwrap().evicted, vec![k(1)]);
    }

    #[test]
    fn remove_frees_the_slot_or_holds_it_until_a_reading_load_ends() {
        let mut ix = Index::new(4);
        store(&mut ix, &[1, 2, 3]);
        assert_eq!(ix.remove(&k(9)), None, "not held");
        // Unpinned: out of the index and the LRU, its slot free at once
        // with its old header to invalidate before reuse.
        let s1 = ix.remove(&k(1)).unwrap();
        assert!(ix.get(&k(1)).is_none());
        assert_eq!((ix.live(), ix.free_slots(), ix.pinned()), (2, 2, 0));
        assert_eq!(ix.remove(&k(1)), None, "removed once");
        // A caller's pin goes with the key; its later unpin is ignored.
        assert!(ix.pin(&k(2)));
        ix.remove(&k(2)).unwrap();
        ix.unpin(&k(2));
        assert_eq!((ix.live(), ix.free_slots(), ix.pinned()), (1, 3, 0));
        // A load reading the block keeps its slot out of the free list.
        assert!(ix.pin_job(&k(3)));
        let s3 = ix.remove(&k(3)).unwrap();
        assert_eq!((ix.live(), ix.free_slots(), ix.pinned()), (0, 3, 0));
        let a = ix.allocate(3).unwrap();
        assert!(!a.slots.contains(&s3) && a.evicted.is_empty());
        assert!(a.needs_invalidate.contains(&s1), "removed header is stale");
        assert!(ix.allocate(1).is_err(), "the read slot is not free yet");
        ix.release_condemned(s3);
        assert_eq!(ix.allocate(1).unwrap().slots, vec![s3]);
    }

    /// An unpin by entry drops nothing once the key was stored anew: the
    /// new entry's pin is another caller's.
    #[test]
    fn unpin_entry_touches_only_the_entry_it_pinned() {
        let mut ix = Index::new(4);
        let a = ix.allocate(1).unwrap().slots[0];
        ix.commit(k(7), a, 10);
        assert_eq!(ix.lookup_and_pin_entries(&[k(7), k(8)]), vec![10]);
        ix.remove(&k(7));
        let b = ix.allocate(1).unwrap().slots[0];
        ix.commit(k(7), b, 11);
        assert_eq!(ix.lookup_and_pin_entries(&[k(7)]), vec![11]);
        ix.unpin_entry(&k(7), 10, 1);
        assert_eq!(ix.get(&k(7)).unwrap().pins, 1, "a stale unpin dropped a live pin");
        ix.unpin_entry(&k(7), 11, 1);
        assert_eq!(ix.get(&k(7)).unwrap().pins, 0);
        assert_eq!(ix.pinned(), 0);
    }

    #[test]
    fn rebuild_keeps_newest_generation() {
        let mut ix = Index::new(8);
        ix.load_header(k(1), 5, 10);
        ix.load_header(k(1), 2, 30);
        ix.load_header(k(1), 7, 20);
        ix.order_lru_by_generation();
        let e = ix.get(&k(1)).unwrap();
        assert_eq!((e.slot, e.generation), (2, 30));
        assert_eq!(ix.live(), 1);
        assert_eq!(ix.free_slots(), 7);
        // The losers' slots are free but must be invalidated before reuse.
        let a = ix.allocate(7).unwrap();
        assert!(a.needs_invalidate.contains(&5) && a.needs_invalidate.contains(&7));
    }
}
