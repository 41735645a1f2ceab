import json,glob,sys
for f in sorted(glob.glob(sys.argv[1]+'.*[0-9]')):
    recs=[json.loads(l) for l in open(f)]
    if max(len(r['running']) for r in recs)<2: continue
    longs={}
    for i,r in enumerate(recs):
        for rid,plen,pre,ing in r['running']:
            if plen>600 and ing: longs.setdefault(rid,[]).append(i)
    for rid,idx in longs.items():
        a,b=idx[0],idx[-1]
        print('req',rid,'steps',len(idx),'span %.2f'%(recs[b]['t0']+recs[b]['dt']-recs[a]['t0']), ' '.join('[%.2fs %sr %sc]'%(recs[i]['dt'],recs[i]['rows'],recs[i]['decodes']) for i in range(a,b+1)))
    dec=[r for r in recs if all(not x[3] for x in r['running']) and len(r['running'])==4]
    print('decode-only 4-stream steps', len(dec), 'mean dt %.3f mean rows %.1f'%(sum(r['dt'] for r in dec)/len(dec), sum(r['rows'] for r in dec)/len(dec)))
