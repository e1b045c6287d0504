"""The controller app's CPU per report without HTTP: ``POST /v1/runs/{run}/reports`` called as an
ASGI app in-process (no uvicorn, no sockets, no load generator), 5 rounds of 2,000 reports of 28
values and two 8-rank vectors. Prints the process CPU time per report of each round and the
smallest; compare two trees by running it with each tree's interpreter back to back:

    .venv/bin/python bench/controller_app_cpu.py
"""
import asyncio, json, tempfile, time, pathlib, statistics
from trainguard.service.app import create_app
from trainguard.service.config import Settings
AG="agent-token-micro"
d=pathlib.Path(tempfile.mkdtemp())
app=create_app(Settings(db=d/"x.db", agent_tokens=(AG,)))
vals={f"trainguard_m{i}":1.0 for i in range(28)}
async def main():
    async with app.router.lifespan_context(app):
        async def call(method, path, body):
            sent=[]
            async def receive(): return {"type":"http.request","body":body,"more_body":False}
            async def send(m): sent.append(m)
            scope={"type":"http","method":method,"path":path,"raw_path":path.encode(),"root_path":"","query_string":b"",
                   "headers":[(b"authorization",f"Bearer {AG}".encode()),(b"content-type",b"application/json"),(b"content-length",str(len(body)).encode())],
                   "http_version":"1.1","scheme":"http","server":("t",80),"client":("c",1),"state":{}}
            await app(scope, receive, send)
            return sent[0]["status"]
        reg=json.dumps({"job":"j","run":"r","world_size":8,"ranks":[]}).encode()
        assert await call("POST","/v1/runs",reg)==200
        times=[]
        for rep in range(5):
            t0=time.process_time()
            for i in range(2000):
                step=rep*2000+i+1
                b=json.dumps({"job":"j","step_first":step,"step_last":step,"time":1.0,"values":vals,"ranks":{"step_time_s":[1.0]*8,"loss":[1.0]*8}}).encode()
                s=await call("POST","/v1/runs/r/reports",b)
                assert s==200, s
            times.append((time.process_time()-t0)/2000*1e6)
        print("us/report", [round(t) for t in times], "min", round(min(times)))
asyncio.run(main())
