// The batch page's script: every second, the batches from ui/batches as table rows. Served
// as a file of its own (the page's Content-Security-Policy runs no inline script); rows are
// built as elements, never from HTML text, and the bars' widths set through CSSOM.
"use strict";
function dur(s){if(s==null||!isFinite(s))return "–";s=Math.max(0,Math.round(s));
 if(s<60)return s+" s";if(s<3600)return Math.floor(s/60)+" min "+(s%60)+" s";
 return Math.floor(s/3600)+" h "+Math.floor((s%3600)/60)+" min";}
function el(tag,cls,text){const e=document.createElement(tag);if(cls)e.className=cls;
 if(text!=null)e.textContent=String(text);return e;}
function cell(text,cls){return el("td",cls,text);}
function row(b,now){const c=b.request_counts,done=c.completed+c.failed,t=c.total||0;
 const pc=t?100*c.completed/t:0,pf=t?100*c.failed/t:0;
 let eta=null;if(b.status=="in_progress"&&b.in_progress_at&&done>0&&done<t){
  const rate=done/Math.max(0.001,now-b.in_progress_at);eta=(t-done)/rate;}
 else if(b.status=="in_progress"||b.status=="validating"){eta=null;}else{eta=0;}
 const tr=el("tr");tr.id="b-"+b.id;
 tr.appendChild(cell(b.id));
 const st=cell(null);st.appendChild(el("span","st "+b.status,b.status));tr.appendChild(st);
 const bar=el("div","bar"),ok=el("div","ok"),bad=el("div","bad");
 ok.style.width=pc+"%";bad.style.width=pf+"%";bar.appendChild(ok);bar.appendChild(bad);
 const progress=cell(null);progress.appendChild(bar);tr.appendChild(progress);
 tr.appendChild(cell((t?Math.floor(100*done/t):0)+" %","num"));
 tr.appendChild(cell(c.completed,"num"));tr.appendChild(cell(c.failed,"num"));
 tr.appendChild(cell(t,"num"));tr.appendChild(cell(dur(now-b.created_at)));
 tr.appendChild(cell(eta===0?"done":dur(eta)));
 return tr;}
async function refresh(){try{const r=await fetch("ui/batches",{credentials:"same-origin"});
 const j=await r.json();document.getElementById("rows").replaceChildren(...j.data.map(b=>row(b,j.now)));
 document.getElementById("meta").textContent=j.data.length+" batch(es), updated "+new Date(j.now*1000).toLocaleTimeString();}
 catch(e){document.getElementById("meta").textContent="cannot reach the service: "+e;}}
refresh();setInterval(refresh,1000);
