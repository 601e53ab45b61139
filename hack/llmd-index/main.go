// llm-d's kv-cache index (github.com/llm-d/llm-d-kv-cache, pinned in go.mod) as a real router for
// kvoffload's KV-event test: llm-d's event pool with its vLLM adapter, one per-pod ZMQ subscriber
// per --pods entry (as the EPP's pod discovery makes them) and its in-memory block index. It answers
// POST /query {"token_ids": [...], "model": "m"} with each pod's longest prefix per device tier
// (llm-d's tier is the event's medium, lowercased), in tokens. Built by hack/setup.sh.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"k8s.io/apimachinery/pkg/util/sets"
)

func main() {
	port := flag.Int("port", 8091, "HTTP port")
	blockSize := flag.Int("block-size", 16, "tokens per block (the engine's)")
	pods := flag.String("pods", "", "pod=tcp://host:port,...")
	flag.Parse()
	ctx := context.Background()
	index, err := kvblock.NewInMemoryIndex(nil)
	if err != nil {
		panic(err)
	}
	tp, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: *blockSize})
	if err != nil {
		panic(err)
	}
	cfg := kvevents.DefaultConfig()
	pool := kvevents.NewPool(cfg, index, tp, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	subs := kvevents.NewSubscriberManager(pool)
	for _, spec := range strings.Split(*pods, ",") {
		pod, endpoint, ok := strings.Cut(spec, "=")
		if !ok {
			fmt.Fprintf(os.Stderr, "bad --pods entry %q\n", spec)
			os.Exit(2)
		}
		if err := subs.EnsureSubscriber(ctx, pod, endpoint, cfg.TopicFilter, true); err != nil {
			panic(err)
		}
	}
	http.HandleFunc("/query", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			TokenIDs []uint32 `json:"token_ids"`
			Model    string   `json:"model"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		keys, err := tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, req.TokenIDs, req.Model, nil)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		found, err := index.Lookup(r.Context(), keys, sets.New[string]())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// pod -> tier -> tokens of the longest prefix held in that tier
		answer := map[string]map[string]int{}
		alive := map[string]bool{}
		for i, key := range keys {
			here := map[string]bool{}
			for _, entry := range found[key] {
				id := entry.PodIdentifier + "\x00" + entry.DeviceTier
				if i == 0 || alive[id] {
					here[id] = true
					pod, tier, _ := strings.Cut(id, "\x00")
					if answer[pod] == nil {
						answer[pod] = map[string]int{}
					}
					answer[pod][tier] = (i + 1) * *blockSize
				}
			}
			alive = here
		}
		_ = json.NewEncoder(w).Encode(answer)
	})
	panic(http.ListenAndServe(fmt.Sprintf("127.0.0.1:%d", *port), nil))
}
