"""CPU emulation of the kernel's P precision (fp32 products of the e4m3 values, online softmax per 128-key tile, P x 2^shift
rounded to e4m3, l from unrounded or rounded P, bf16 output) against float64 on the dequantized inputs.

    PYTHONPATH=lab/gluon_fp8_attention python lab/gluon_fp8_attention/emulate_p_rounding.py   # ~10 s

Not the tensor core's own fp8 accumulation; an estimate of the error P's rounding alone causes."""
import torch, run_gpu as r, math
r.DEVICE="cpu"
torch.manual_seed(0)
def emulate(q8,k8,v8,qd,kd,vd,causal,shift_bits=8,tile=128, sum_quantized=False):
    B,Sq,H,D=q8.shape; Skv=k8.shape[1]
    out=torch.zeros(B,Sq,H,D,dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s=(q8[b,:,h].float()@k8[b,:,h].float().T)  # raw fp32
            c=float(qd[b,h])*float(kd[b,h])*D**-0.5*math.log2(math.e)
            if causal:
                i=torch.arange(Sq)[:,None]; j=torch.arange(Skv)[None,:]
                s=s.masked_fill(j>i+Skv-Sq,float('-inf'))
            m=torch.full((Sq,),float('-inf')); l=torch.zeros(Sq); acc=torch.zeros(Sq,D)
            for t0 in range(0,Skv,tile):
                st=s[:,t0:t0+tile]
                mn=torch.maximum(m,st.max(1).values)
                ms=torch.where(mn==float('-inf'),torch.zeros_like(mn),mn*c)
                alpha=torch.exp2(m*c-ms)
                p=torch.exp2(st*c-ms[:,None]+shift_bits)
                pq=p.to(torch.float8_e4m3fn).float()
                l=l*alpha+(pq if sum_quantized else p).sum(1)
                acc=acc*alpha[:,None]+pq@v8[b,t0:t0+tile,h].float()
                m=mn
            out[b,:,h]=(acc*float(vd[b,h])/torch.where(l==0,torch.ones_like(l),l)[:,None]).to(torch.bfloat16).double()
    return out
for (Sq,vm,causal) in [(1024,0.0,False),(1024,1.0,False),(2048,0.0,True),(4096,0.0,False)]:
    q8,k8,v8,qd,kd,vd=r.make_inputs(1,Sq,Sq,1,1,128,False,v_mean=vm)
    ref,pairs=r.reference(q8,k8,v8,qd,kd,vd,causal)
    res=[]
    for sb,sq in [(0,False),(8,False),(8,True)]:
        o=emulate(q8,k8,v8,qd,kd,vd,causal,sb,sum_quantized=sq)
        res.append("shift%d%s %.3e"%(sb,"+sumq" if sq else "",r.errors(r.pick(o,pairs),ref)[0]))
    o=emulate(q8,k8,v8,qd,kd,vd,causal,8)
    scale_o=448/ref.abs().max().item()  # a cuDNN-like e4m3 O (its error on top of P's)
    o8=(o*scale_o).to(torch.float8_e4m3fn).double()/scale_o
    res.append("shift8, O e4m3 %.3e"%r.errors(r.pick(o8,pairs),ref)[0])
    print(Sq,vm,causal,res)
