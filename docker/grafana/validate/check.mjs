// Type-check Grafana dashboard JSON files against Grafana's own schema (@grafana/schema) with the TypeScript
// compiler (tests/deploy/test_dashboard.py runs it). Each dashboard becomes an object literal typed as a Dashboard
// whose panels are time series panels with Prometheus targets, so tsc reports wrong types, missing required
// fields and unknown keys (excess-property checks), with the JSON's line numbers.
//   node check.mjs FILE.json...      exit 0 when every file checks, 1 with the errors otherwise
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.join(here, ".generated");
fs.mkdirSync(out, { recursive: true });
const HEADER = `import type { Dashboard, DataQuery, Panel } from "@grafana/schema";
import type { Options as TimeSeriesOptions, FieldConfig as TimeSeriesFieldConfig } from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";
// a Prometheus query (the datasource plugin's own fields beyond DataQuery)
interface PromTarget extends DataQuery { expr: string; legendFormat?: string; range?: boolean; instant?: boolean; format?: "time_series" | "table" | "heatmap"; }
type TimeSeriesPanel = Panel<TimeSeriesOptions, TimeSeriesFieldConfig> & { type: "timeseries"; targets: PromTarget[]; options: TimeSeriesOptions };
// the schema's TypeScript enums as the string values the JSON holds (an enum is not assignable from its value)
type Loose<T> = T extends string ? \`\${T}\` : T extends number ? T : T extends boolean ? T
  : T extends (infer U)[] ? Loose<U>[] : T extends object ? { [K in keyof T]: Loose<T[K]> } : T;
export const dashboard: Loose<Omit<Dashboard, "panels"> & { panels: TimeSeriesPanel[] }> =
`;
const files = process.argv.slice(2);
if (files.length === 0) { console.error("usage: node check.mjs FILE.json..."); process.exit(2); }
const roots = [];
const origin = new Map();
for (const file of files) {
  const text = fs.readFileSync(file, "utf8");
  JSON.parse(text); // invalid JSON: the exception names the position
  const ts_file = path.join(out, path.basename(file).replace(/\.json$/, "") + ".ts");
  fs.writeFileSync(ts_file, HEADER + text.trimEnd() + ";\n");
  roots.push(ts_file);
  origin.set(path.resolve(ts_file), file);
}
const offset = HEADER.split("\n").length - 1; // lines before the JSON in the generated file
const program = ts.createProgram(roots, {
  strict: true, noEmit: true, target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.ESNext,
  moduleResolution: ts.ModuleResolutionKind.Bundler, skipLibCheck: true, types: [],
});
const diagnostics = ts.getPreEmitDiagnostics(program);
for (const d of diagnostics) {
  const message = ts.flattenDiagnosticMessageText(d.messageText, "\n");
  if (d.file) {
    const { line, character } = d.file.getLineAndCharacterOfPosition(d.start ?? 0);
    const src = origin.get(path.resolve(d.file.fileName)) ?? d.file.fileName;
    console.error(`${src}:${line + 1 - offset}:${character + 1}: ${message}`);
  } else {
    console.error(message);
  }
}
console.log(`${files.length} dashboard(s), ${diagnostics.length} error(s)`);
process.exit(diagnostics.length ? 1 : 0);
