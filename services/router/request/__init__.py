"""Step 2 of a request's path, `http -> request -> admission -> scheduling -> relay`: one exchange.

`handler` authenticates, reads the few body keys the router needs (`body`, checked by
`validation`), asks admission, then walks the endpoints scheduling ranks. `exchange` owns
every byte sent back to the client; `guard` turns a deadline or a gone client into one
exception; `kinds` says, per API kind, which paths it has and how its streams end.
`stored` sends the calls about a stored Responses API answer to the engine that made it.
"""
