// Offline entry point for sphinxcontrib-mermaid, which imports mermaid as an ES module.
// mermaid.min.js (mermaid 11.12.1, vendored from npm) is a classic script that assigns
// globalThis.mermaid, so it is loaded with a <script> element and then re-exported.
await new Promise((resolve, reject) => {
  const script = document.createElement("script");
  script.src = new URL("./mermaid.min.js", import.meta.url).href;
  script.onload = resolve;
  script.onerror = () => reject(new Error(`could not load ${script.src}`));
  document.head.appendChild(script);
});
export default globalThis.mermaid;
