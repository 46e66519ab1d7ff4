"""train/hlo.py reads collectives, their sizes and their executions per step from HLO text."""
from train import hlo

# A module in XLA's text format: a while loop with a known trip count of 12 around a fusion that
# holds an all-gather, an async all-reduce pair, a combined (tuple) all-reduce in the entry, a
# reduce-scatter wrapped in an async pair (GPU) and a loop whose trip count XLA could not prove.
MODULE = '''HloModule jit_train_step, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

%gathering (p: bf16[128,64]) -> bf16[1024,64] {
  %p = bf16[128,64]{1,0} parameter(0)
  ROOT %all-gather.7 = bf16[1024,64]{1,0} all-gather(%p), channel_id=1, dimensions={0}, use_global_device_ids=true
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %weights = bf16[128,64]{1,0} constant({...})
  %fusion.3 = bf16[1024,64]{1,0} fusion(%weights), kind=kLoop, calls=%gathering
  %value = f32[8]{0} get-tuple-element(%state), index=1
  %all-reduce-start.2 = f32[8]{0} all-reduce-start(%value), channel_id=2, to_apply=%add
  %all-reduce-done.2 = f32[8]{0} all-reduce-done(%all-reduce-start.2)
  ROOT %tuple = (s32[], f32[8]{0}) tuple(%i, %all-reduce-done.2)
}

%wrapped (q: f32[64]) -> f32[8] {
  %q = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.6 = f32[8]{0} reduce-scatter(%q), channel_id=4, dimensions={0}, to_apply=%add
}

%cond (state: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%unknown_body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %collective-permute.4 = s32[16,4]{1,0} collective-permute(%x), channel_id=5, source_target_pairs={{0,1}}
}

ENTRY %main.9 (a: f32[16,32]) -> f32[] {
  %a = f32[16,32]{1,0} parameter(0)
  %while.1 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"12"}}
  %while.2 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%unknown_body
  %all-reduce.5 = (f32[16,32]{1,0}, f32[]) all-reduce(%a, %b), channel_id=3, to_apply=%add
  %async-start.1 = ((f32[64]{0}), f32[8]{0}, u32[]) async-start(%c), calls=%wrapped
  %async-done.1 = f32[8]{0} async-done(%async-start.1), calls=%wrapped
  ROOT %out = f32[] constant(0)
}
'''


def test_collectives_with_kinds_shapes_bytes_and_loop_multipliers():
  found = {c.name: c for c in hlo.collectives(MODULE)}
  assert set(found) == {'all-gather.7', 'all-reduce-done.2', 'collective-permute.4', 'all-reduce.5', 'reduce-scatter.6'}
  assert (found['reduce-scatter.6'].multiplier, found['reduce-scatter.6'].bytes) == (1, 8 * 4)
  gather = found['all-gather.7']
  assert (gather.kind, gather.dtype, gather.shape, gather.bytes) == ('all-gather', 'bf16', (1024, 64), 1024 * 64 * 2)
  assert (gather.computation, gather.multiplier, gather.static) == ('gathering', 12, True)
  assert (found['all-reduce-done.2'].kind, found['all-reduce-done.2'].multiplier) == ('all-reduce', 12)
  combined = found['all-reduce.5']
  assert combined.arrays == (('f32', (16, 32)), ('f32', ())) and combined.bytes == 16 * 32 * 4 + 4
  assert combined.multiplier == 1 and combined.leads_with((16, 32)) and not combined.leads_with((32,))
  permute = found['collective-permute.4']
  assert (permute.multiplier, permute.static, permute.bytes) == (1, False, 16 * 4 * 4)


def test_collective_bytes_per_step_by_kind():
  assert hlo.collective_bytes(MODULE) == {'all-gather': 12 * 1024 * 64 * 2, 'all-reduce': 12 * 8 * 4 + 16 * 32 * 4 + 4,
                                          'reduce-scatter': 8 * 4, 'all-to-all': 0, 'collective-permute': 16 * 4 * 4}
