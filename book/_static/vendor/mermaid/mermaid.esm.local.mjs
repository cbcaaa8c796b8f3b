// Offline entry point for sphinxcontrib-mermaid, which imports mermaid as an ES module.
// mermaid.min.js (mermaid 11.12.1, vendored from npm) assigns globalThis.mermaid when it runs.
import "./mermaid.min.js";
export default globalThis.mermaid;
