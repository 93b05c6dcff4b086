"""Which link sets deepep-ht's projected dispatch time on the trained 64-expert fixture at EP 16
over 2 nodes: the busiest rank's NVLink and RDMA time per MoE layer and step, smoe's placement
(its predicted order, capacity as built) against vLLM's linear order (contiguous chunks).

    python benchmarks/ht_link_binding.py PLACEMENT.yaml TOKENS_PER_RANK CLUSTER
"""
import sys, numpy as np
from vllm_smoe.formats.trace import open_trace
from vllm_smoe.formats.placement_file import load_placement, load_tables
from vllm_smoe.formats.cluster_spec import load_cluster, wire_for
from vllm_smoe.placement.a2a_cost import _pairs, _rows, NVLINK, RDMA
from vllm_smoe.placement.assign import contiguous_tokens
from vllm_smoe.placement.online import simulate
from vllm_smoe.placement.metrics import holds_from_expert2rank
t=open_trace('vllm_smoe/testbed/assets/traces/qwen3_moe_e64/heldout.npz')
arr={k:t[k] for k in ['token_ids','request_ids','positions','topk_ids','is_prefill']}
p=load_placement(sys.argv[1]); tab=load_tables(p)
N=16; tpr=int(sys.argv[2]); cl=load_cluster(sys.argv[3]); w,_=wire_for(cl,'deepep-ht',N,4096,8)
T=(arr['token_ids'].size//(tpr*N))*tpr*N
arr={k:v[:T] for k,v in arr.items()}; batch=np.arange(T)//(tpr*N)
holds=holds_from_expert2rank(p.expert2rank,N,p.replicas)
t2r_s,_=simulate(tab,holds,arr['token_ids'],arr['topk_ids'],batch,N,p.capacity,arr['request_ids'],arr['is_prefill'],'tables-markov',arr['positions'])
lin=np.tile(np.arange(64)//4,(4,1))
t2r_l=np.repeat(contiguous_tokens(batch,N)[:,None],4,axis=1)
for name,e2r,t2r in [('smoe',p.expert2rank,t2r_s),('linear',lin,t2r_l)]:
    nv=rd=0; n=0
    for s in np.unique(batch):
        m=batch==s
        for L in range(4):
            topk=arr['topk_ids'][m,L].astype(np.int64); src=t2r[m,L]
            loc=holds[L][src[:,None],topk] if name=='smoe' else (e2r[L][topk]==src[:,None])
            dest=np.where(loc,src[:,None],e2r[L][topk])
            snd,rcv,_=_pairs(dest,src,N,8,'deepep-ht'); r=_rows(snd,rcv,N,8)
            nv+=r[NVLINK].max()*w.dispatch_row_bytes/w.dispatch.nvlink_Bps; rd+=r[RDMA].max()*w.dispatch_row_bytes/w.dispatch.rdma_Bps; n+=1
    print(name,'dispatch busiest NVLink us %.1f RDMA us %.1f'%(1e6*nv/n,1e6*rd/n))
